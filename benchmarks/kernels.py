"""Kernels a planner launches per call, counted without a GPU: python -m benchmarks.kernels

On a GPU the planners are chains of small dependent kernels, and their latency follows the kernel
count, not the arithmetic (`benchmarks/results/gpu/`: on one H200 at R = 32, topoep, taot and eplb
took 1.2-1.7 ms where the `none` planner's call took 0.13). This compiles each planner as the GPU
runs it (rounds.run_rounds' rounds unrolled at their static count, not the CPU's early exit, and the
pairwise orders of arrays.pairwise_or_sorted, not the CPU's sorts) with
XLA:CPU, and counts the compiled program's kernels: every instruction of the entry computation
but parameters, constants, tuples and bitcasts, and each loop's body times its trip count. XLA:GPU
fuses differently from XLA:CPU, so the count is a proxy; `--calibrate FILE` fits
latency = a + b x kernels to a gpu_check.json's planner latencies and projects each row with it.

--target h100 counts the same way in the program XLA:GPU compiles for an H100 without one
(benchmarks.gpu_target; needs JAX's CUDA plugin): XLA:GPU's own fusions, so the kernels a GPU
launches, not a proxy. Its latency line is fitted to the H200 timings at the XLA:GPU counts of the
programs timed (planner_kernels.json), and it also counts each planner at the cluster projection's
planner shapes (R = 32: benchmarks.planners.SHAPES) and the time their kernels add inside a step
(the line's slope times the kernels), which benchmarks.cluster charges. Writes kernels_h100.json and
kernels_h100.md.

For R = 8 ... 1024 (nodes of 8 GPUs), E = max(256, R), K = 2. Writes benchmarks/results/kernels.json
and kernels.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import time

import jax
import numpy as np

from benchmarks.planners import SHAPES, in_layer, make, shape_key
from benchmarks.scale import GPUS, loads
from jtopoep.config import TopologyConfig
from jtopoep.planners import arrays, rounds

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RANKS = (8, 32, 64, 128, 256, 512, 1024)
PLANNERS = ("none", "eplb", "topoep", "taot")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{name: instruction lines} of a compiled HLO module's text, and the entry's name."""
    found, current, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(2)
            found[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            found[current].append(line)
    return found, entry


def _opcode(line: str) -> str | None:
    line = re.sub(r"/\*[^*]*\*/", "", line)  # tuple types carry /*index=N*/ comments
    found = re.search(r"=\s*(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(", line)
    return found.group(1) if found else None


def loop_trip_count(line: str) -> int | None:
    """A compiled `while` instruction's known trip count, None where XLA found none."""
    trip = re.search(r'known_trip_count[\\"]*:\{[\\"]*n[\\"]*:[\\"]*(\d+)', line)
    return int(trip.group(1)) if trip else None


def trip_counts(hlo: str) -> list[int | None]:
    """Every loop of a compiled module: its known trip count, or None."""
    return [loop_trip_count(line) for line in hlo.splitlines() if _opcode(line) == "while"]


def kernel_count(hlo: str) -> int:
    """Kernels one run of a compiled module launches: loops count their body times their known
    trip count (a loop without one is refused: its count is not static), calls what they call,
    conditionals their costlier branch."""
    comps, entry = computations(hlo)

    def count(name: str) -> int:
        total = 0
        for line in comps[name]:
            op = _opcode(line)
            if op is None or op in FREE:
                continue
            if op == "while":
                trips = loop_trip_count(line)
                if trips is None:
                    raise ValueError(f"a loop without a known trip count: {line.strip()[:120]}")
                total += trips * count(re.search(r"body=%?([\w.\-]+)", line).group(1))
            elif op == "call":  # XLA:CPU wraps small loops in calls
                total += count(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
            elif op == "conditional":  # the predicate's read, then the costlier branch
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else [
                    re.search(r"true_computation=%?([\w.\-]+)", line).group(1),
                    re.search(r"false_computation=%?([\w.\-]+)", line).group(1)]
                total += 1 + max(count(b) for b in names)
            else:
                total += 1
        return total

    return count(entry)


def planner_kernels(name: str, num_ranks: int, device=None, num_experts: int | None = None,
                    guest_slots: int = 2) -> tuple[int, float]:
    """The compiled planner's kernel count, its loops at the GPU's static trip count, and the seconds
    XLA took to compile it (lowered already), for `device` (a described GPU, benchmarks.gpu_target) or,
    without one, for XLA:CPU. E defaults to max(256, R)."""
    topology = TopologyConfig(num_nodes=max(num_ranks // GPUS, 1), gpus_per_node=min(GPUS, num_ranks)).to_topology()
    num_experts = num_experts or max(256, num_ranks)
    sample = loads("zipf-1.0", num_ranks, num_experts, 1)[0]
    if device is None:
        sample = jax.numpy.asarray(sample)
    else:
        sample = jax.ShapeDtypeStruct(sample.shape, jax.numpy.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    saved = rounds.EARLY_EXIT_PLATFORMS, arrays.SORTED_ORDER_PLATFORMS
    # Compile the forms the GPU runs: the rounds at their static count, the pairwise orders.
    rounds.EARLY_EXIT_PLATFORMS, arrays.SORTED_ORDER_PLATFORMS = (), ()
    try:
        lowered = jax.jit(in_layer(make(name, topology, num_experts, guest_slots, 0.0))).lower(sample)
        start = time.perf_counter()
        hlo = lowered.compile().as_text()
        seconds = time.perf_counter() - start
    finally:
        rounds.EARLY_EXIT_PLATFORMS, arrays.SORTED_ORDER_PLATFORMS = saved
    return kernel_count(hlo), seconds


def calibrate(gpu_check: pathlib.Path, target: str = "cpu") -> dict | None:
    """Least-squares latency = a + b x kernels over the planners gpu_check timed at R = 32, each at the
    kernel count of the program it timed, as the target counts it (planner_kernels.json beside
    gpu_check.json: the planners change between GPU runs, and today's counts against older latencies
    would fit nothing; for the h100 target, the XLA:GPU counts gpu_check records beside its timings
    where it did); None without those counts."""
    timed = gpu_check.with_name("planner_kernels.json")
    key = "kernels" if target == "cpu" else "xla_gpu_kernels"
    checked = json.loads(gpu_check.read_text())
    if target != "cpu" and "planner_kernels" in checked:  # counted by gpu_check in the programs it timed
        counts = checked["planner_kernels"]
    elif timed.exists() and key in json.loads(timed.read_text()):
        counts = json.loads(timed.read_text())[key]
    else:
        print(f"no {key} in {timed}: the latency line is not fitted (it needs the counts of the programs gpu_check "
              "timed)")
        return None
    measured = checked["planner_latency_us"]
    names = [n for n in PLANNERS if n in measured and n in counts]
    x = np.array([counts[n] for n in names], float)
    y = np.array([measured[n] for n in names], float)
    slope, intercept = np.polyfit(x, y, 1)
    return {"device": measured["device"], "intercept_us": float(intercept), "us_per_kernel": float(slope),
            "measured_us": {n: float(measured[n]) for n in names},
            "fitted_us": {n: float(intercept + slope * counts[n]) for n in names}, "timed_kernels": counts}


def projected_s(fit: dict, kernels: int) -> float:
    """Seconds a call of `kernels` kernels takes on the fitted line."""
    return (fit["intercept_us"] + fit["us_per_kernel"] * kernels) * 1e-6


def in_step_s(fit: dict, kernels: int) -> float:
    """Seconds `kernels` kernels add inside a training step: the line's slope alone. Its intercept is
    a call's own cost (dispatch, the wait for the result: what the `none` planner's call of a few
    kernels takes in gpu_check.json), which a planner inside the jitted step does not pay."""
    return fit["us_per_kernel"] * kernels * 1e-6


def markdown(table: dict, fit: dict | None, target: str = "cpu", compile_s: dict | None = None,
             by_shape: dict | None = None) -> str:
    compiled = ("XLA:CPU-compiled program: `python -m benchmarks.kernels`" if target == "cpu" else
                "program XLA:GPU compiles for an H100 (described, not present): `python -m benchmarks.kernels "
                "--target h100`")
    lines = ["Kernels per planner call as the GPU runs it (loops at their static trip count), counted in the "
             f"{compiled}. E = max(256, R), K = 2, nodes of 8 GPUs.", ""]
    if fit:
        lines += [f"Projected GPU latency (not measured beyond R = 32): {fit['intercept_us']:.0f} us + "
                  f"{fit['us_per_kernel']:.2f} us x kernels, fitted to the {fit['device']} latencies at R = 32 "
                  f"({', '.join(f'{n} {v:.0f} us' for n, v in fit['measured_us'].items())}, at their kernel counts then: "
                  f"{', '.join(f'{n} {v}' for n, v in fit['timed_kernels'].items())}); it counts "
                  f"launches only, not the data each kernel moves, which grows with R.", ""]
    if compile_s:
        lines += ["Compile s: XLA:GPU compiling the lowered planner for the H100, on this machine's CPU, one run "
                  "(a GPU host compiles the same program).", ""]
    columns = ["R"] + [f"{n} kernels" for n in PLANNERS]
    columns += [f"{n} projected ms" for n in PLANNERS if n != "none"] if fit else []
    columns += [f"{n} compile s" for n in PLANNERS if n != "none"] if compile_s else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for ranks, row in table.items():
        cells = [str(row[n]) for n in PLANNERS]
        if fit:
            cells += [f"{projected_s(fit, row[n]) * 1e3:.2f}" for n in PLANNERS if n != "none"]
        if compile_s:
            cells += [f"{compile_s[ranks][n]:.1f}" for n in PLANNERS if n != "none"]
        lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
    if by_shape:
        lines += ["", "### At the cluster projection's planner shapes", "",
                  "In-step ms: the kernels' share of the line (its slope times the kernels, without the intercept, a "
                  "call's own cost), the planning that benchmarks.cluster charges inside a step.", "",
                  "| shape | " + " | ".join(f"{n} kernels" for n in PLANNERS) + (
                      " | " + " | ".join(f"{n} in-step ms" for n in PLANNERS if n != "none") if fit else "") + " |",
                  "|" + "---|" * (1 + len(PLANNERS) + (len(PLANNERS) - 1 if fit else 0))]
        for key, row in by_shape.items():
            cells = [str(row[n]) for n in PLANNERS]
            if fit:
                cells += [f"{in_step_s(fit, row[n]) * 1e3:.2f}" for n in PLANNERS if n != "none"]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--calibrate", type=pathlib.Path, default=RESULTS / "gpu" / "gpu_check.json",
                        help="a gpu_check.json with planner latencies at R = 32 (none to skip)")
    parser.add_argument("--target", choices=("cpu", "h100"), default="cpu",
                        help="count in XLA:CPU's program (a proxy) or in XLA:GPU's for an H100 "
                             "(needs JAX's CUDA plugin)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    device, on_target = None, contextlib.nullcontext()
    if args.target == "h100":
        from benchmarks import gpu_target

        if not gpu_target.cuda_plugin_installed():
            parser.error(gpu_target.NEEDS_PLUGIN)
        (device,) = gpu_target.described_gpus(1, 1)
        on_target = gpu_target.answering_as([device])
    table, compile_s, by_shape = {}, {}, {}
    with on_target:
        for ranks in args.ranks:
            measured = {name: planner_kernels(name, ranks, device) for name in PLANNERS}
            table[ranks] = {name: kernels for name, (kernels, _) in measured.items()}
            compile_s[ranks] = {name: seconds for name, (_, seconds) in measured.items()}
            print(ranks, table[ranks], compile_s[ranks], flush=True)
        if args.target == "h100":  # the cluster projection's planner shapes besides the table's
            for experts, slots in SHAPES:
                by_shape[shape_key(32, experts, slots)] = {name: planner_kernels(name, 32, device, experts, slots)[0]
                                                           for name in PLANNERS}
                print(experts, slots, by_shape[shape_key(32, experts, slots)], flush=True)
    fit = calibrate(args.calibrate, args.target) if args.calibrate.exists() else None
    for ranks, row in table.items():
        by_shape.setdefault(shape_key(ranks, max(256, ranks), 2), row)
    result = {"target": args.target, "kernels": {str(r): row for r, row in table.items()},
              "compile_s": {str(r): row for r, row in compile_s.items()}, "gpu_fit": fit}
    if args.target == "h100":
        result["by_shape"] = by_shape
        if fit:
            result["in_step_s_by_shape"] = {key: {n: in_step_s(fit, k) for n, k in row.items() if n != "none"}
                                            for key, row in by_shape.items()}
    stem = "kernels" if args.target == "cpu" else f"kernels_{args.target}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(table, fit, args.target, compile_s if args.target != "cpu" else None,
                    by_shape if args.target == "h100" else None)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
