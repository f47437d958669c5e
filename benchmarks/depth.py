"""Compile time of the training step against model depth: python -m benchmarks.depth [--quick]

The train step (forward, backward, AdamW update; topoep with 2 guest slots, the README's tiny model
on 8 emulated CPU devices, 2 nodes x 4) for models of 2 to 16 MoE layers, with the MoE layers run by
jax.lax.scan over their stacked weights (model.scan_layers, the default) and by a Python loop over
them (one compiled copy per layer). Times XLA:CPU's lowering and compile of the step ahead of time
(nnx.jit(...).lower(...).compile()), one process, nothing else running; and the median of 7 warm steps.
Writes benchmarks/results/depth.json and depth.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEPTHS = (2, 4, 8, 16)
LOOPED_DEPTHS = (2, 4, 8)  # a looped 16-layer step takes minutes to compile
STEPS = 7  # warm steps timed; the median


def measure(layers: int, scan: bool, run_dir: str) -> dict:
    import jax

    from jtopoep.config import load_config
    from train.loop import Trainer

    config = load_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml",
                         [f"model.num_layers={layers}", f"model.scan_layers={str(scan).lower()}", "moe.replace_every=0",
                          f"train.run_dir={run_dir}/{layers}_{scan}"])
    trainer = Trainer(config, fresh=True)
    batch = trainer._device_batch(0)
    began = time.perf_counter()
    lowered = trainer.train_step.lower(trainer.model, trainer.optimizer, batch)
    lowered_s = time.perf_counter() - began
    compiled = lowered.compile()
    compile_s = time.perf_counter() - began - lowered_s
    del compiled
    jax.block_until_ready(trainer.train_step(trainer.model, trainer.optimizer, batch))  # warm (compiles again)
    steps = []
    for _ in range(STEPS):
        began = time.perf_counter()
        jax.block_until_ready(trainer.train_step(trainer.model, trainer.optimizer, batch))
        steps.append(time.perf_counter() - began)
    return {"moe_layers": layers, "scan_layers": scan, "lower_s": lowered_s, "compile_s": compile_s,
            "step_s": statistics.median(steps)}


def markdown(rows: list[dict]) -> str:
    lines = ["# Training-step compile time against depth", "",
             "`python -m benchmarks.depth`: the train step of `configs/tiny_cpu.yaml` (topoep, 2 guest slots, "
             "8 emulated CPU devices as 2 x 4) with more MoE layers, compiled ahead of time by XLA:CPU on this "
             "machine; `model.scan_layers` true runs the MoE layers with jax.lax.scan, false with a Python loop.", "",
             "| MoE layers | scan_layers | trace and lower s | compile s | warm step s (median of 7) |", "|---|---|---|---|---|"]
    lines += [f"| {r['moe_layers']} | {str(r['scan_layers']).lower()} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
              f"{r['step_s']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 and 4 layers only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    from jtopoep import xla_cpu

    xla_cpu.configure()  # as the trainer runs
    xla_cpu.emulate_cpu_devices(8)
    cases = [(n, True) for n in DEPTHS] + [(n, False) for n in LOOPED_DEPTHS]
    if args.quick:
        cases = [(n, scan) for n, scan in cases if n <= 4]
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        for layers, scan in cases:
            rows.append(measure(layers, scan, run_dir))
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "depth.json").write_text(json.dumps(rows, indent=1))
    (args.out / "depth.md").write_text(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
