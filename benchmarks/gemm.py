"""The experts' grouped GEMM on CPU: python -m benchmarks.gemm [--quick]

Forward and backward (value_and_grad) of one grouped GEMM, float32, every row in a group, for
moe.gemm `xla` (jax.lax.ragged_dot, which XLA:CPU expands into a dense product per group over the
whole buffer) and `tiled` (jtopoep.gemm_tiled), on one pinned core: the median of 7 rounds, the
GEMMs taking turns. Each shape is timed twice, in two processes: with XLA's default CPU settings,
and with jtopoep.xla_cpu.configure() as the trainer and the tests run (it compiles loops that touch
little memory into one kernel, products included). Writes benchmarks/results/gemm_cpu.json and .md.
GPUs are timed by benchmarks/gpu_check.sh (grouped_gemm).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# (rows, depth, width, groups): the tiny model's layer, then wider experts with 2, 4 and 10 slots.
SHAPES = ((4096, 64, 64, 4), (4096, 256, 512, 2), (4096, 256, 512, 4), (4096, 256, 512, 10), (16384, 512, 512, 4))
GEMMS = ("xla", "tiled")


def measure(shapes, rounds: int, pin: bool = True) -> list[dict]:
    """Milliseconds per call of each GEMM at each shape, in this process's XLA settings (pin: every
    thread of the process on one core)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.planners import pin_to_one_core
    from jtopoep.gemm import grouped_matmul

    if pin:
        pin_to_one_core()
    rows_out = []
    for rows, depth, width, groups in shapes:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(rows, depth)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(groups, depth, width)), jnp.float32)
        sizes = jnp.asarray(np.diff(np.linspace(0, rows, groups + 1).astype(int)), jnp.int32)
        fns = {g: jax.jit(jax.value_and_grad(lambda x, w, g=g: (grouped_matmul(x, w, sizes, g) ** 2).sum(),
                                             argnums=(0, 1))) for g in GEMMS}
        for fn in fns.values():
            jax.block_until_ready(fn(x, w))
        times = {g: [] for g in GEMMS}
        for _ in range(rounds):
            for g, fn in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(x, w))
                times[g].append(time.perf_counter() - start)
        row = {"rows": rows, "depth": depth, "width": width, "groups": groups}
        row.update({f"{g}_ms": statistics.median(t) * 1e3 for g, t in times.items()})
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first two shapes, 3 rounds")
    parser.add_argument("--configured", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    shapes, rounds = (SHAPES[:2], 3) if args.quick else (SHAPES, 7)
    if args.configured:
        from jtopoep import xla_cpu

        xla_cpu.configure()
        print(json.dumps(measure(shapes, rounds)))
        return {}
    default = measure(shapes, rounds)
    command = [sys.executable, "-m", "benchmarks.gemm", "--configured"] + (["--quick"] if args.quick else [])
    child = subprocess.run(command, check=True, capture_output=True, text=True)
    configured = json.loads(child.stdout.strip().splitlines()[-1])
    result = {"default": default, "configured": configured}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_cpu.json").write_text(json.dumps(result, indent=1))
    lines = ["Forward and backward of one grouped GEMM, float32, on one CPU core (median of "
             f"{rounds} rounds), milliseconds. `python -m benchmarks.gemm`", "",
             "| rows | depth | width | groups | xla | tiled | xla, configured | tiled, configured |",
             "|---|---|---|---|---|---|---|---|"]
    for d, c in zip(default, configured):
        lines.append(f"| {d['rows']} | {d['depth']} | {d['width']} | {d['groups']} | {d['xla_ms']:.2f} | "
                     f"{d['tiled_ms']:.2f} | {c['xla_ms']:.2f} | {c['tiled_ms']:.2f} |")
    lines += ["", "configured: jtopoep.xla_cpu.configure(), as the trainer and the tests run; `moe.gemm: auto` is "
              "`xla` on CPU for that reason."]
    (args.out / "gemm_cpu.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
