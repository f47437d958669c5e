"""Compile time of the training step against model depth: python -m benchmarks.depth [--target h100] [--quick]

The train step (forward, backward and AdamW update of every micro-batch) for models of more and more
MoE layers, with the MoE layers run by jax.lax.scan over their stacked weights (model.scan_layers, the
default) and by a Python loop over them (one compiled copy of the layer, planner included, per layer).
Times the step's trace and lowering and its compile ahead of time (nnx.jit(...).lower(...).compile()),
one process, nothing else running.

- --target cpu (default): configs/tiny_cpu.yaml (topoep, 2 guest slots) on 8 emulated CPU devices
  (2 x 4), compiled by XLA:CPU, 2 to 16 MoE layers; and the median of 7 warm steps of each.
- --target h100: configs/deepseek_v2_lite_h800_4x8.yaml (DeepSeek-V2-Lite's shape, topoep, 32 GPUs,
  4 micro-batches of one 4096-token sequence per GPU), compiled by XLA:GPU for 32 H100s that are not
  here (benchmarks.gpu_target; needs JAX's CUDA plugin), 2 MoE layers up to the model's 26, the whole
  model also with less rematerialisation than the run file's (model.remat); and XLA's memory
  analysis per device.

Writes benchmarks/results/depth.json and depth.md (depth_h100.* for --target h100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time

from benchmarks import gpu_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = {"cpu": ROOT / "configs" / "tiny_cpu.yaml", "h100": ROOT / "configs" / "deepseek_v2_lite_h800_4x8.yaml"}
# (MoE layers, scan_layers, model.remat or None for the run file's) per target: a looped step's
# compile grows with its depth. On H100 the whole model also with less rematerialisation, to show
# what the run file's choice saves.
CASES = {"cpu": [(n, True, None) for n in (2, 4, 8, 16)] + [(n, False, None) for n in (2, 4, 8)],
         "h100": [(n, True, None) for n in (2, 8, 26)] + [(26, True, "attention"), (26, True, "none")]
         + [(n, False, None) for n in (2, 4)]}
STEPS = 7  # warm steps timed on CPU; the median


def _config(target: str, layers: int, scan: bool, remat: str | None, overrides: tuple[str, ...] = ()):
    """The target's run file with `layers` MoE layers after its dense first layers."""
    from jtopoep.config import load_config

    config = load_config(RUNS[target], list(overrides))
    model = dataclasses.replace(config.model, num_layers=config.model.first_dense_layers + layers, scan_layers=scan,
                                remat=remat or config.model.remat)
    return dataclasses.replace(config, model=model)


def measure_cpu(layers: int, scan: bool, remat: str | None, run_dir: str) -> dict:
    import jax

    from train.loop import Trainer

    config = _config("cpu", layers, scan, remat, ("moe.replace_every=0", f"train.run_dir={run_dir}/{layers}_{scan}"))
    trainer = Trainer(config, fresh=True)
    batch = trainer._device_batch(0)
    row = _compile(trainer.train_step, (trainer.model, trainer.optimizer, batch))
    jax.block_until_ready(trainer.train_step(trainer.model, trainer.optimizer, batch))  # warm (compiles again)
    steps = []
    for _ in range(STEPS):
        began = time.perf_counter()
        jax.block_until_ready(trainer.train_step(trainer.model, trainer.optimizer, batch))
        steps.append(time.perf_counter() - began)
    return {"moe_layers": layers, "scan_layers": scan, "remat": config.model.remat, **row,
            "step_s": statistics.median(steps)}


def measure_h100(layers: int, scan: bool, remat: str | None, devices) -> dict:
    """The step compiled for described H100s, on abstract weights and optimizer state (nothing is
    allocated), sharded as the trainer shards them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jtopoep.layer import ExpertParam
    from jtopoep.topology import make_mesh
    from models.moe_transformer import EXPERT_SPEC, MoETransformer
    from train.loop import make_optimizer, make_train_step

    config = _config("h100", layers, scan, remat)
    topology = config.topology.to_topology()
    with gpu_target.answering_as(devices):
        mesh = make_mesh(topology, devices=devices)

        def build():
            model = MoETransformer(config.model, config.moe, topology, mesh, rngs=nnx.Rngs(0))
            return model, nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)

        model, optimizer = nnx.eval_shape(build)
        experts = {tuple(path): v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(model, ExpertParam))}
        for module in (model, optimizer):  # expert weights and their moments split over the ranks, the rest replicated
            for path, node in nnx.iter_graph(module):
                if isinstance(node, nnx.Variable):
                    value = node.get_value()
                    split = any(tuple(path[-len(p):]) == p and value.shape == shape for p, shape in experts.items())
                    sharding = NamedSharding(mesh, EXPERT_SPEC if split else P())
                    node.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        t = config.train
        tokens = jax.ShapeDtypeStruct((t.microbatches, t.batch_size // t.microbatches, config.model.seq_len + 1),
                                      jnp.int32, sharding=NamedSharding(mesh, P(None, mesh.axis_names)))
        row = _compile(make_train_step(config.moe, mesh), (model, optimizer, tokens), memory=True)
    return {"moe_layers": layers, "scan_layers": scan, "remat": config.model.remat, **row}


def _compile(step, args, memory: bool = False) -> dict:
    began = time.perf_counter()
    lowered = step.lower(*args)
    lowered_s = time.perf_counter() - began
    compiled = lowered.compile()
    row = {"lower_s": lowered_s, "compile_s": time.perf_counter() - began - lowered_s}
    if memory:
        analysis = compiled.memory_analysis()
        row.update(temp_gb=analysis.temp_size_in_bytes / 1e9, argument_gb=analysis.argument_size_in_bytes / 1e9)
    return row


def markdown(target: str, rows: list[dict]) -> str:
    if target == "cpu":
        what = ("the train step of `configs/tiny_cpu.yaml` (topoep, 2 guest slots, 8 emulated CPU devices as 2 x 4), "
                "compiled ahead of time by XLA:CPU on this machine")
        extra = [("warm step s (median of 7)", lambda r: f"{r['step_s']:.2f}")]
    else:
        what = ("the train step of `configs/deepseek_v2_lite_h800_4x8.yaml` (DeepSeek-V2-Lite's shape, topoep, "
                "4 micro-batches) compiled by XLA:GPU for 32 H100s without them (a 2-core machine compiles; the "
                "MoE layer count is overridden, the dense first layer kept)")
        extra = [("temporaries GB per device", lambda r: f"{r['temp_gb']:.2f}"),
                 ("arguments GB per device", lambda r: f"{r['argument_gb']:.2f}")]
    lines = ["# Training-step compile time against depth", "",
             f"`python -m benchmarks.depth{' --target h100' if target == 'h100' else ''}`: {what}; "
             "`model.scan_layers` true runs the MoE layers with jax.lax.scan, false with a Python loop.", "",
             "| MoE layers | scan_layers | remat | trace and lower s | compile s | "
             + " | ".join(h for h, _ in extra) + " |",
             "|---|---|---|---|---|" + "---|" * len(extra)]
    lines += [f"| {r['moe_layers']} | {str(r['scan_layers']).lower()} | {r['remat']} | {r['lower_s']:.1f} | "
              f"{r['compile_s']:.1f} | "
              + " | ".join(f(r) for _, f in extra) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("cpu", "h100"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="2 and 4 MoE layers only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    cases = [case for case in CASES[args.target] if not args.quick or case[0] <= 4]
    rows = []
    if args.target == "h100":
        if not gpu_target.cuda_plugin_installed():
            parser.error(gpu_target.NEEDS_PLUGIN)
        devices = gpu_target.described_gpus(4, 8)
        for case in cases:
            rows.append(measure_h100(*case, devices))
            print(rows[-1], flush=True)
    else:
        from jtopoep import xla_cpu

        xla_cpu.configure()  # as the trainer runs
        xla_cpu.emulate_cpu_devices(8)
        with tempfile.TemporaryDirectory() as run_dir:
            for case in cases:
                rows.append(measure_cpu(*case, run_dir))
                print(rows[-1], flush=True)
    stem = "depth" if args.target == "cpu" else "depth_h100"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(args.target, rows))
    return rows


if __name__ == "__main__":
    main()
