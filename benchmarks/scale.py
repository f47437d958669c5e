"""Planning at scale: python -m benchmarks.scale [--max-ranks 1024] [--quick]

For R = 8, 32, 64, 128, 256, 512 and 1024 ranks (nodes of 8 H800 GPUs), E = max(256, R) experts,
K = 2 guest slots, 4096 tokens per rank and top-8 routing: each planner's latency (jitted, every
thread on one core, the median over 7 rounds, the planners taking turns, of the median of 10 calls)
and compile time, and its balance (median imbalance over the lower bound, pricing on and off) and
inter-node bytes against eplb's, on Zipf 1.0,
lognormal, hot-node and burst loads. Beside them DeepSeek's EPLB (global and hierarchical policies,
benchmarks.deepseek_eplb), a host re-placement of every expert, with its balance and host time.
A planner whose call took longer than --budget seconds at one R is not run at larger R (the table
says so). Writes benchmarks/results/scale.json and scale.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from benchmarks import deepseek_eplb
from benchmarks.planners import DIMS, in_layer, make, pin_to_one_core, set_cpu_dispatch, time_call
from jtopoep import traces, xla_cpu
from jtopoep.config import TopologyConfig
from jtopoep.metrics import summarize

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RANKS = (8, 32, 64, 128, 256, 512, 1024)
GPUS, SLOTS, TOKENS, TOP_K = 8, 2, 4096, 8
PLANNERS = ("eplb", "topoep", "taot")
FAMILIES = ("zipf-1.0", "lognormal", "hot-node", "bursts")


def loads(family: str, num_ranks: int, num_experts: int, steps: int, seed: int = 0) -> np.ndarray:
    """int32 [steps, R, E] micro-batches of one load family."""
    rng = np.random.default_rng(seed)
    if family == "zipf-1.0":
        return traces.zipf(num_ranks, num_experts, TOKENS, TOP_K, 1.0, steps=steps, drift=2, seed=seed)
    if family == "bursts":
        return traces.bursts(num_ranks, num_experts, TOKENS, TOP_K, steps, share=0.5, every=1, seed=seed)
    if family == "lognormal":
        p = rng.lognormal(0.0, 1.0, num_experts)
    elif family == "hot-node":  # the experts homed on node 0 are four times as popular
        p = np.ones(num_experts)
        p[: num_experts // (num_ranks // GPUS)] *= 4.0
    else:
        raise ValueError(f"unknown family {family!r}; known: {list(FAMILIES)}")
    return np.stack([traces.sample_counts(p, num_ranks, TOKENS, TOP_K, rng) for _ in range(steps)])


def eplb_anchor(mats: np.ndarray, num_ranks: int) -> dict:
    """DeepSeek's EPLB on each micro-batch's loads: median imbalance over the bound, and host seconds."""
    out = {}
    nodes = num_ranks // GPUS
    for policy in ("global", "hierarchical"):
        ratios, seconds = [], []
        for counts in mats:
            expert_loads = counts.sum(0)
            start = time.perf_counter()
            if policy == "global":
                rank_loads = deepseek_eplb.global_policy(expert_loads, num_ranks, expert_loads.size // num_ranks + SLOTS)
            else:
                # Groups as DeepSeek-V3's group-limited routing has them (8), or one a node on more nodes.
                rank_loads = deepseek_eplb.hierarchical_policy(expert_loads, nodes, GPUS,
                                                               expert_loads.size // num_ranks + SLOTS, max(8, nodes))
            seconds.append(time.perf_counter() - start)
            mean = rank_loads.mean()
            ratios.append(rank_loads.max() / mean / (np.ceil(rank_loads.sum() / num_ranks) / mean))
        out[f"deepseek_{policy}"] = {"balance": float(np.median(ratios)), "host_s": float(np.median(seconds))}
    return out


def at_scale(num_ranks: int, steps: int, calls: int, skip: set[str], rounds: int) -> dict:
    topology = TopologyConfig(num_nodes=max(num_ranks // GPUS, 1), gpus_per_node=min(GPUS, num_ranks)).to_topology()
    num_experts = max(256, num_ranks)
    families = {f: loads(f, num_ranks, num_experts, steps) for f in FAMILIES}
    row = {"ranks": num_ranks, "experts": num_experts, "latency_s": {}, "compile_s": {}, "balance": {},
           "inter_bytes_vs_eplb": {}, "skipped": sorted(skip)}
    sample = jax.numpy.asarray(families["zipf-1.0"][0])
    executables = {}
    for name in PLANNERS:
        if name in skip:
            continue
        for priced in (True, False) if name != "eplb" else (True,):  # eplb prices nothing
            planner = make(name, topology, num_experts, SLOTS, 0.0, price_transfers=priced)
            fn = jax.jit(planner)
            if priced:
                start = time.perf_counter()
                executables[name] = jax.jit(in_layer(planner)).lower(sample).compile()
                row["compile_s"][name] = time.perf_counter() - start
            key = f"{name}{'' if priced else ' (unpriced)'}"
            for family, mats in families.items():
                stats = [summarize(jax.device_get(fn(counts)), counts, topology, DIMS) for counts in mats]
                row["balance"][(key, family)] = float(np.median([s["imbalance"] / s["imbalance_lower_bound"]
                                                                 for s in stats]))
                row["inter_bytes_vs_eplb"][(key, family)] = float(np.mean([s["inter_bytes"] for s in stats]))
    # The planners take turns, round after round, so that the machine's drift in speed falls on all
    # of them alike.
    seconds = {name: [] for name in executables}
    for _ in range(rounds):
        for name, executable in executables.items():
            seconds[name].append(time_call(executable, sample, calls))
    row["latency_s"].update({name: float(np.median(s)) for name, s in seconds.items()})
    for family, mats in families.items():
        base = row["inter_bytes_vs_eplb"].get(("eplb", family))
        for key in [k for k in row["inter_bytes_vs_eplb"] if k[1] == family]:
            # One node has no inter-node bytes to compare.
            row["inter_bytes_vs_eplb"][key] = row["inter_bytes_vs_eplb"][key] / base - 1 if base else None
        for name, result in eplb_anchor(mats, num_ranks).items():
            row["balance"][(name, family)] = result["balance"]
            row["latency_s"].setdefault(name, []).append(result["host_s"])
    for name in ("deepseek_global", "deepseek_hierarchical"):
        row["latency_s"][name] = float(np.median(row["latency_s"][name]))
    return row


def markdown(rows: list[dict], budget: float) -> str:
    def cell(row, table, key):
        value = row[table].get(key)
        return "not run" if value is None else value

    names = list(PLANNERS) + ["deepseek_global", "deepseek_hierarchical"]
    out = [f"Planning at scale: nodes of {GPUS} H800 GPUs, E = max(256, R), K = {SLOTS}, {TOKENS} tokens per rank, "
           f"top-{TOP_K}. Latency: jitted, every thread on one core, median over rounds (the planners taking turns) of "
           f"the median of a batch of calls (DeepSeek's EPLB: "
           f"host NumPy, no device copies). A planner whose call took over {budget} s is not run at larger R.",
           "", "### Latency (ms) and compile time (s)", "",
           "| R | E | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} compile s" for n in PLANNERS)
           + " |", "|" + "---|" * (2 + len(names) + len(PLANNERS))]
    for row in rows:
        lat = [cell(row, "latency_s", n) for n in names]
        comp = [cell(row, "compile_s", n) for n in PLANNERS]
        out.append(f"| {row['ranks']} | {row['experts']} | "
                   + " | ".join(v if isinstance(v, str) else f"{v * 1e3:.2f}" for v in lat) + " | "
                   + " | ".join(v if isinstance(v, str) else f"{v:.1f}" for v in comp) + " |")
    keys = (["eplb"] + [f"{n}{s}" for n in PLANNERS[1:] for s in ("", " (unpriced)")]
            + ["deepseek_global", "deepseek_hierarchical"])
    for family in FAMILIES:
        out += ["", f"### Balance on {family}: median imbalance / lower bound (inter-node bytes vs eplb)", "",
                "| R | " + " | ".join(keys) + " |", "|" + "---|" * (1 + len(keys))]
        for row in rows:
            cells = []
            for key in keys:
                value = row["balance"].get((key, family))
                bytes_ = row["inter_bytes_vs_eplb"].get((key, family))
                cells.append("not run" if value is None else
                             f"{value:.3f}" + ("" if bytes_ is None else f" ({bytes_:+.0%})"))
            out.append(f"| {row['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-ranks", type=int, default=RANKS[-1])
    parser.add_argument("--quick", action="store_true", help="one micro-batch per family, few calls")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds a call may take before larger R is skipped")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    set_cpu_dispatch(False)
    xla_cpu.configure()
    pin_to_one_core()
    rows, skip = [], set()
    for num_ranks in (r for r in RANKS if r <= args.max_ranks):
        row = at_scale(num_ranks, 1 if args.quick else 3, 3 if args.quick else 10, set(skip),
                       1 if args.quick else 7)
        rows.append(row)
        skip |= {name for name, seconds in row["latency_s"].items() if name in PLANNERS and seconds > args.budget}
        print(f"R = {num_ranks}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row["latency_s"].items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    serial = [{**r, "balance": {" | ".join(k): v for k, v in r["balance"].items()},
               "inter_bytes_vs_eplb": {" | ".join(k): v for k, v in r["inter_bytes_vs_eplb"].items()}} for r in rows]
    (args.out / "scale.json").write_text(json.dumps(serial, indent=1))
    (args.out / "scale.md").write_text(markdown(rows, args.budget))
    return rows


if __name__ == "__main__":
    main()
