"""Planner quality and latency on h800-4x8: python -m benchmarks.planners [--quick] [--scale ...]

For every load family (real traces and synthetic), E in {64, 256} and K in {1, 2}: imbalance (median
and worst over micro-batches), gap to the lower bound, inter-node pairs and bytes, weighted
communication cost relative to eplb, projected MoE-layer time from the cost model; and planning
latency (jitted, and the host eplb planner with its device copies, timed in interleaved rounds of
the same run). Writes benchmarks/results/planners.json and planners.md.

--scale runs the scale table instead (benchmarks.scale: R = 8 to 1024 ranks, E = max(256, R), K = 2,
one pinned core, ratios in one run); the arguments after it go to that benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.loads import all_families, synthetic_families
from jtopoep import xla_cpu
from jtopoep.config import MoEConfig
from jtopoep.costmodel import ExpertDims, layer_time
from jtopoep.gemm import resolve_weight_chunks
from jtopoep.metrics import inter_bytes_floor, summarize
from jtopoep.planners import eplb_host, get_planner
from jtopoep.rank_route import planned_route
from jtopoep.topology import Topology

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PLANNERS = ("none", "eplb", "topoep", "taot")
# DeepSeek-V2-Lite expert shapes (configs/models/deepseek-v2-lite.yaml), bf16, guest weights in the
# slices a GPU's default (tiled) GEMM takes.
DIMS = ExpertDims(d_model=2048, expert_hidden=1408, bytes_per_element=2,
                  weight_chunks=resolve_weight_chunks(MoEConfig.guest_weight_chunks, "tiled", 1408))
TOKENS_PER_RANK = 4096


def make(name, topology, num_experts, guest_slots, min_gain, **extra):
    return get_planner(name, topology=topology, num_experts=num_experts,
                       guest_slots=0 if name == "none" else guest_slots, min_gain=min_gain, dims=DIMS, **extra)


def in_layer(planner):
    """What a layer computes to plan, as rank 0 does: the planner's slots and quotas, and the part of
    the route that rank derives from them (jtopoep.rank_route.planned_route). The planners' latency
    is this function's; the whole [R, R, S] route (calling the planner) is for analysis only."""
    def plan_in_layer(counts):
        quotas = planner.quotas(counts)
        return planned_route(counts, quotas, planner.tiered, 0, 0, planner.gpus_per_node)
    return plan_in_layer


def time_call(fn, arg, repeats: int) -> float:
    """Median seconds of fn(arg), results waited for."""
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Executables per planner that latency() times: identical programs compiled separately have run at
# different speeds here (the same HLO and buffer assignment, their machine code laid out apart), so
# the figure is the median over several executables, not one draw.
COMPILES = 4


def latency(topology, counts, min_gain: float, rounds: int, batch: int = 25, compiles: int = COMPILES,
            guest_slots: int = 2) -> dict:
    """Seconds per call of every planner (jitted) and of eplb_host (with its device copies).

    Each jitted planner is compiled `compiles` times into separate executables (see COMPILES).
    This machine's speed drifts by tens of percent from one second to the next. The executables take
    turns: each round times a batch of back-to-back calls of each (a batch, so each call finds the
    previous one's code and data warm), and a planner's figure is the median over rounds and over its
    executables of the batch means, so a slow spell falls on all of them alike. Each round's ratio of
    eplb_host to topoep (its mean over topoep's executables in that round) is paired within the
    round. Returns medians, minima, each executable's median and that ratio's median."""
    device_counts = jax.device_put(jnp.asarray(counts))
    planners = {name: make(name, topology, counts.shape[1], guest_slots, min_gain) for name in PLANNERS}
    # A new function object per executable: jax.jit caches compilations per function.
    fns = {(name, i): jax.jit(lambda c, planner=planner: in_layer(planner)(c))
           for name, planner in planners.items() for i in range(compiles)}
    host = make("eplb", topology, counts.shape[1], guest_slots, min_gain)
    fns[("eplb_host", 0)] = lambda c: eplb_host(host, c)
    sizes = {key: max(batch // 10, 2) if key[0] == "eplb_host" else batch for key in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(device_counts))
    means = {key: [] for key in fns}
    for r in range(rounds):
        for key in (list(fns) if r % 2 else list(fns)[::-1]):
            fn = fns[key]
            start = time.perf_counter()
            for _ in range(sizes[key]):
                jax.block_until_ready(fn(device_counts))
            means[key].append((time.perf_counter() - start) / sizes[key])
    by_name = {}
    for (name, _), values in means.items():
        by_name.setdefault(name, []).extend(values)
    topoep_rounds = [statistics.mean(means[("topoep", i)][r] for i in range(compiles)) for r in range(rounds)]
    ratio = [h / t for h, t in zip(means[("eplb_host", 0)], topoep_rounds)]
    return {"median_s": {k: statistics.median(v) for k, v in by_name.items()},
            "min_s": {k: min(v) for k, v in by_name.items()},
            "per_compile_median_s": {name: [statistics.median(means[(name, i)]) for i in range(compiles)]
                                     for name in planners},
            "eplb_host_over_topoep": statistics.median(ratio), "rounds": rounds, "batch": batch,
            "compiles": compiles}


def set_cpu_dispatch(asynchronous: bool) -> None:
    """Choose how the CPU client runs a jitted call; it takes effect only before JAX's first use of
    the CPU, so each benchmark process picks one mode.

    By default (asynchronous) JAX hands every call to a worker thread and the caller waits for it;
    with it off the caller's thread runs the program itself. On this 2-core machine the handoffs
    cost more than the planner's work (JAX's flag help: async dispatch pays for large computations,
    not small ones), so the planner benchmark times inline runs, the way a latency-bound CPU caller
    would configure JAX, and records the default mode's figures beside them from a second process.
    On GPU the planner runs inside the jitted training step and neither mode applies."""
    jax.config.update("jax_cpu_enable_async_dispatch", asynchronous)


# The headline latency comes from a child process with every thread on one core. The benchmark's
# own process, on both cores, times the same planners in the same way: there XLA:CPU hands the
# kernels that are ready together to its thread pool on the other core, and on this virtual machine
# a handoff that wakes the other core costs more than a planner kernel and varies from run to run.
# In three alternating pairs of runs (30 rounds each), both cores gave topoep 279, 421 and 329 us
# and eplb 290, 375 and 320; one core 228, 228 and 215, and eplb 284, 283 and 285. A latency-bound
# CPU caller of a program of small kernels keeps it on one core, as it runs calls inline; XLA:CPU
# has no setting for its thread count, which follows the process's CPU affinity.
HEADLINE_MODE = "one_core"
# The process configurations latency() runs in as child processes, each one change from this
# process's: JAX's default asynchronous dispatch; XLA's defaults (jtopoep.xla_cpu not configured);
# its small-loop setting alone; every thread on one core (the headline).
CHILD_MODES = {
    "async_dispatch": "JAX's default asynchronous CPU dispatch",
    "xla_defaults": "XLA's defaults (jtopoep.xla_cpu not configured)",
    "small_loops_only": "jtopoep.xla_cpu's small-loop limit alone (XLA's default scheduler)",
    "one_core": "every thread of the process on one core (sched_setaffinity): the headline",
}


def latency_in_child(mode: str, rounds: int, xla_flags: str, shapes: bool = False) -> dict:
    """latency() in a fresh process in another configuration (CHILD_MODES): neither JAX's dispatch
    mode nor XLA's flags can change once a process has started JAX. `xla_flags` is XLA_FLAGS as this
    process found it, before jtopoep.xla_cpu.configure(). shapes: shape_latency() instead."""
    flags = ["--latency-shapes" if shapes else "--latency-only", f"--rounds={rounds}"]
    flags.append("--" + mode.replace("_", "-"))
    out = subprocess.run([sys.executable, "-m", "benchmarks.planners", *flags], check=True, capture_output=True,
                         text=True, cwd=pathlib.Path(__file__).resolve().parents[1],
                         env={**os.environ, "XLA_FLAGS": xla_flags})
    return json.loads(out.stdout.strip().splitlines()[-1])


def pin_to_one_core() -> None:
    """Every thread of this process on its first allowed core: the threads there are now, and those
    started later, which inherit it."""
    core = {min(os.sched_getaffinity(0))}
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), core)


def zipf_latency(topology, min_gain: float, rounds: int, quick: bool, num_experts: int = 256,
                 guest_slots: int = 2) -> dict:
    """latency() on the first Zipf 1.0 micro-batch, in this process's dispatch mode."""
    counts = synthetic_families(topology.num_ranks, num_experts, TOKENS_PER_RANK, 4 if quick else 16)["zipf-1.0"][0]
    return latency(topology, counts, min_gain, rounds, guest_slots=guest_slots)


# The planner shapes (E, K) at R = 32 besides the headline's (256, 2) whose latency the cluster
# projection charges (benchmarks.cluster.Deployment: Mixtral's 8 experts as 32 slices, DeepSeek-V2-Lite's
# 64, Qwen1.5-MoE's 60 padded to 64, DeepSeek-V3's 256; K = 1, 2, 4). eplb's work grows with E and K,
# topoep's copy loop with K: one figure for every shape would misprice both.
SHAPES = ((32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (64, 4), (256, 1), (256, 4))


def shape_key(num_ranks: int, num_experts: int, guest_slots: int) -> str:
    return f"R={num_ranks}, E={num_experts}, K={guest_slots}"


def shape_latency(topology, min_gain: float, rounds: int, quick: bool) -> dict:
    """zipf_latency() at each of SHAPES, keyed by shape_key()."""
    return {shape_key(topology.num_ranks, e, k): zipf_latency(topology, min_gain, rounds, quick, e, k)
            for e, k in SHAPES}


def evaluate(topology, families: dict, num_experts: int, guest_slots: int, min_gain: float,
             only: tuple = PLANNERS, overrides: dict | None = None) -> dict:
    rows = {}
    overrides = overrides or {}
    planners = {name: jax.jit(make(name, topology, num_experts, guest_slots, min_gain, **overrides.get(name, {})))
                for name in only}
    for family, mats in families.items():
        for name, fn in planners.items():
            stats = []
            for counts in mats:
                plan = jax.device_get(fn(counts))
                s = summarize(plan, counts, topology, DIMS)
                placement = np.arange(num_experts).reshape(topology.num_ranks, -1)
                s["layer_ms"] = layer_time(plan, topology, DIMS, placement)["total_s"] * 1e3
                stats.append(s)
            col = lambda k: np.array([s[k] for s in stats])  # noqa: E731
            rows[(family, name)] = {
                "imbalance_median": float(np.median(col("imbalance"))),
                "imbalance_worst": float(col("imbalance").max()),
                "lower_bound_median": float(np.median(col("imbalance_lower_bound"))),
                "gap_to_bound_median": float(np.median(col("imbalance") / col("imbalance_lower_bound") - 1)),
                "inter_pairs": float(col("inter_pairs").mean()),
                "inter_bytes": float(col("inter_bytes").mean()),
                "inter_weight_bytes": float(col("inter_weight_bytes").mean()),
                "guest_copies": float(col("guest_copies").mean()),
                "wcc": float(col("wcc").mean()),
                "layer_ms": float(col("layer_ms").mean()),
                "microbatches": len(stats),
            }
        if "eplb" not in only:
            continue
        base = rows[(family, "eplb")]
        # Only read against eplb's bytes (floor_table), so only computed where eplb ran.
        floor = float(np.mean([inter_bytes_floor(c, topology, DIMS, guest_slots) for c in mats]))
        for name in only:
            row = rows[(family, name)]
            row["inter_bytes_vs_eplb"] = row["inter_bytes"] / base["inter_bytes"] - 1
            row["wcc_vs_eplb"] = row["wcc"] / base["wcc"] - 1
            row["inter_bytes_floor"] = floor
            row["floor_vs_eplb"] = floor / base["inter_bytes"] - 1
    return rows


def sweeps(topology, families: dict, repeats: int) -> dict:
    """Knob sweeps on E = 256, K = 2 (zipf-1.0 and esft-intent): the figures that chose the defaults."""
    loads = {k: families[k] for k in ("zipf-1.0", "esft-intent")}
    out = {"min_gain": [], "sinkhorn": []}
    for price in (True, False):
        for min_gain in (0.0, 0.25, 0.5, 1.0) if price else (0.0,):
            for name in ("topoep", "taot"):
                rows = evaluate(topology, loads, 256, 2, min_gain, only=(name,),
                                overrides={name: dict(price_transfers=price)})
                for family in loads:
                    r = rows[(family, name)]
                    out["min_gain"].append({"planner": name, "price_transfers": price, "min_gain": min_gain,
                                            "load": family, "imbalance_median": r["imbalance_median"],
                                            "gap_to_bound_median": r["gap_to_bound_median"],
                                            "layer_ms": r["layer_ms"], "inter_bytes": r["inter_bytes"],
                                            "wcc": r["wcc"]})
    sample = jnp.asarray(loads["zipf-1.0"][0])
    for epsilon in (0.01, 0.05, 0.2, 1.0):
        for iterations in (10, 20, 50):
            planner = make("taot", topology, 256, 2, 0.0, epsilon=epsilon, iterations=iterations)
            rows = evaluate(topology, loads, 256, 2, 0.0, only=("taot",),
                            overrides={"taot": dict(epsilon=epsilon, iterations=iterations)})
            out["sinkhorn"].append({
                "epsilon": epsilon, "iterations": iterations,
                "latency_us": time_call(jax.jit(in_layer(planner)), sample, repeats) * 1e6,
                **{f"{family}_{k}": rows[(family, "taot")][k] for family in loads
                   for k in ("imbalance_median", "wcc", "layer_ms")}})
    return out


def floor_table(rows: list[dict]) -> list[str]:
    """Inter-node bytes against their floor (metrics.inter_bytes_floor): how far below eplb any plan
    with these guest slots could go, and how much of that cut each topology-aware planner makes."""
    by = {(r["load"], r["planner"]): r for r in rows}
    lines = ["Inter-node bytes (tokens plus guest weights) against the floor no plan with these guest slots "
             "can go below, home experts fixed, whatever its balance:", "",
             "| load | eplb GB | floor GB | floor vs eplb | topoep vs eplb | taot vs eplb | "
             "share of the reachable cut: topoep, taot |", "|---|---|---|---|---|---|---|"]
    for load in dict.fromkeys(r["load"] for r in rows):
        eplb, topoep, taot = (by[(load, p)] for p in ("eplb", "topoep", "taot"))
        cut = eplb["inter_bytes"] - eplb["inter_bytes_floor"]
        share = ", ".join(f"{100 * (eplb['inter_bytes'] - r['inter_bytes']) / cut:.0f}%" if cut > 0 else "-"
                          for r in (topoep, taot))
        lines.append(f"| {load} | {eplb['inter_bytes'] / 1e9:.2f} | {eplb['inter_bytes_floor'] / 1e9:.2f} | "
                     f"{100 * eplb['floor_vs_eplb']:+.1f}% | {100 * topoep['inter_bytes_vs_eplb']:+.1f}% | "
                     f"{100 * taot['inter_bytes_vs_eplb']:+.1f}% | {share} |")
    lines.append("")
    return lines


def markdown(results: dict) -> str:
    lines = []
    lat, method = results["latency_us"], results["latency_method"]
    lines.append(f"Planning latency, R = 32, E = 256, K = 2, jitted, on one core of this machine ({results['device']}; "
                 f"every thread of the measuring process on one core, HEADLINE_MODE says why): each "
                 f"planner compiled {method['compiles']} times into separate executables (COMPILES says why), the "
                 f"median over {method['rounds']} interleaved rounds and over its executables of the mean call in a "
                 f"batch of {method['batch']} back-to-back calls (eplb_host: a tenth of that): "
                 + ", ".join(f"{k} {v:.0f} us" for k, v in lat.items())
                 + f"; eplb_host / topoep = {results['eplb_host_over_topoep']:.1f}x (median of the per-round ratios).")
    lines.append("Fastest round: " + ", ".join(f"{k} {v:.0f} us" for k, v in results["latency_min_us"].items()) + ".")
    lines.append("Each executable's median: " + "; ".join(f"{k} " + ", ".join(f"{v:.0f}" for v in values) + " us"
                                                       for k, values in results["latency_per_compile_us"].items()) + ".")
    lines.append("Calls run inline on the caller's thread (jax_cpu_enable_async_dispatch=False) and XLA:CPU compiles "
                 "the planners' loops into single kernels and schedules for memory (jtopoep.xla_cpu.configure()), all "
                 "set by the benchmark. "
                 "The same measurement in other configurations, each in its own process (medians); the first row is "
                 "the benchmark's own process, on both cores, and each row after it changes one thing from that:")
    lines.append("")
    names = list(lat)
    both = results["latency_both_cores"]
    lines.append("| configuration | " + " | ".join(f"{k} us" for k in names) + " | eplb_host / topoep |")
    lines.append("|---|" + "---|" * (len(names) + 1))
    lines.append("| both cores (this process) | " + " | ".join(f"{both['median_s'][k] * 1e6:.0f}" for k in names)
                 + f" | {both['eplb_host_over_topoep']:.1f}x |")
    for mode, child in results.get("latency_children", {}).items():
        lines.append(f"| {CHILD_MODES[mode]} | " + " | ".join(f"{child['median_s'][k] * 1e6:.0f}" for k in names)
                     + f" | {child['eplb_host_over_topoep']:.1f}x |")
    lines.append("")
    if "latency_by_shape_us" in results:
        lines.append("The same measurement at the other planner shapes the cluster projection charges (one core, "
                     "half the rounds; R = 32, E = 256, K = 2 is the headline above):")
        lines.append("")
        lines.append("| shape | " + " | ".join(f"{k} us" for k in names) + " | eplb_host / topoep |")
        lines.append("|---|" + "---|" * (len(names) + 1))
        for key, row in results["latency_by_shape_us"].items():
            lines.append(f"| {key} | " + " | ".join(f"{row[k]:.0f}" for k in names)
                         + f" | {results['eplb_host_over_topoep_by_shape'][key]:.1f}x |")
        lines.append("")
    for setting, rows in results["settings"].items():
        lines.append(f"### {setting}")
        lines.append("")
        lines.append("| load | planner | imbalance median | worst | gap to bound | inter-node GB | vs eplb | "
                     "WCC vs eplb | copies | layer ms |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            lines.append(f"| {row['load']} | {row['planner']} | {row['imbalance_median']:.3f} | "
                         f"{row['imbalance_worst']:.3f} | {100 * row['gap_to_bound_median']:.1f}% | "
                         f"{row['inter_bytes'] / 1e9:.2f} | {100 * row['inter_bytes_vs_eplb']:+.0f}% | "
                         f"{100 * row['wcc_vs_eplb']:+.0f}% | {row['guest_copies']:.0f} | {row['layer_ms']:.2f} |")
        lines.append("")
        lines.extend(floor_table(rows))
    if "sweeps" in results:
        lines.append("### Knob sweeps (E = 256, K = 2; latency on one core, one compilation each)")
        lines.append("")
        lines.append("| planner | price_transfers | min_gain | load | imbalance median | gap to bound | layer ms | "
                     "inter-node GB |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in results["sweeps"]["min_gain"]:
            lines.append(f"| {r['planner']} | {r['price_transfers']} | {r['min_gain']} | {r['load']} | "
                         f"{r['imbalance_median']:.3f} | {100 * r['gap_to_bound_median']:.1f}% | {r['layer_ms']:.2f} | "
                         f"{r['inter_bytes'] / 1e9:.2f} |")
        lines.append("")
        lines.append("| taot epsilon | iterations | latency us | zipf-1.0 imbalance | zipf-1.0 layer ms "
                     "| esft-intent imbalance | esft-intent layer ms |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results["sweeps"]["sinkhorn"]:
            lines.append(f"| {r['epsilon']} | {r['iterations']} | {r['latency_us']:.0f} | "
                         f"{r['zipf-1.0_imbalance_median']:.3f} | {r['zipf-1.0_layer_ms']:.2f} | "
                         f"{r['esft-intent_imbalance_median']:.3f} | {r['esft-intent_layer_ms']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--scale" in argv:
        from benchmarks import scale

        return scale.main([a for a in argv if a != "--scale"])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer micro-batches, for a smoke run")
    parser.add_argument("--min-gain", type=float, default=0.0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--async-dispatch", action="store_true",
                        help="time with JAX's default asynchronous CPU dispatch (see set_cpu_dispatch)")
    parser.add_argument("--xla-defaults", action="store_true", help="leave XLA:CPU's options as they are "
                        "(skip jtopoep.xla_cpu.configure())")
    parser.add_argument("--small-loops-only", action="store_true",
                        help="jtopoep.xla_cpu.configure() without the memory-optimised scheduler")
    parser.add_argument("--one-core", action="store_true",
                        help="run every thread of this process on one core (set before JAX starts its threads)")
    parser.add_argument("--latency-only", action="store_true", help="print latency() as JSON and stop")
    parser.add_argument("--latency-shapes", action="store_true",
                        help="print shape_latency() (every shape of SHAPES) as JSON and stop")
    parser.add_argument("--rounds", type=int, default=None, help="latency rounds (default 100, 8 with --quick)")
    args = parser.parse_args(argv)
    if args.one_core:
        pin_to_one_core()
    inherited_flags = os.environ.get("XLA_FLAGS", "")
    if not args.xla_defaults:
        xla_cpu.configure(memory_scheduler=not args.small_loops_only)
    set_cpu_dispatch(args.async_dispatch)
    topology = Topology.preset("h800-4x8")
    rounds = args.rounds or (8 if args.quick else 100)
    if args.latency_only or args.latency_shapes:
        lat = (shape_latency if args.latency_shapes else zipf_latency)(topology, args.min_gain, rounds, args.quick)
        print(json.dumps(lat))
        return lat
    results = {"topology": "h800-4x8", "dims": DIMS.__dict__, "tokens_per_rank": TOKENS_PER_RANK,
               "min_gain": args.min_gain, "device": jax.devices()[0].device_kind,
               "settings": {}}
    lat = zipf_latency(topology, args.min_gain, rounds, args.quick)
    children = {mode: latency_in_child(mode, rounds, inherited_flags) for mode in CHILD_MODES}
    head = children[HEADLINE_MODE]
    results["latency_configuration"] = HEADLINE_MODE
    results["latency_us"] = {k: v * 1e6 for k, v in head["median_s"].items()}
    results["latency_min_us"] = {k: v * 1e6 for k, v in head["min_s"].items()}
    results["latency_method"] = {k: head[k] for k in ("rounds", "batch", "compiles")}
    results["latency_per_compile_us"] = {k: [t * 1e6 for t in v] for k, v in head["per_compile_median_s"].items()}
    results["eplb_host_over_topoep"] = head["eplb_host_over_topoep"]
    results["latency_both_cores"] = lat
    results["latency_children"] = children
    # Half the headline's rounds: these only price planning in the cluster projection.
    by_shape = latency_in_child(HEADLINE_MODE, max(rounds // 2, 2), inherited_flags, shapes=True)
    by_shape[shape_key(topology.num_ranks, 256, 2)] = head
    keys = [shape_key(topology.num_ranks, e, k) for e, k in sorted(SHAPES + ((256, 2),))]
    results["latency_by_shape_us"] = {key: {k: v * 1e6 for k, v in by_shape[key]["median_s"].items()} for key in keys}
    results["eplb_host_over_topoep_by_shape"] = {key: by_shape[key]["eplb_host_over_topoep"] for key in keys}
    # The evaluation and the sweeps run on one core from here: the sweeps time taot's Sinkhorn
    # settings, measured as the headline is (HEADLINE_MODE).
    pin_to_one_core()
    for num_experts in (256, 64):
        families = all_families(topology.num_ranks, num_experts, TOKENS_PER_RANK, args.quick)
        for guest_slots in (2, 1):
            rows = evaluate(topology, families, num_experts, guest_slots, args.min_gain)
            key = f"E={num_experts}, K={guest_slots}"
            results["settings"][key] = [{"load": f, "planner": p, **r} for (f, p), r in rows.items()]
            print(key, "done", flush=True)
    if not args.quick:
        results["sweeps"] = sweeps(topology, all_families(topology.num_ranks, 256, TOKENS_PER_RANK, True), 100)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planners.json").write_text(json.dumps(results, indent=1))
    (args.out / "planners.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
