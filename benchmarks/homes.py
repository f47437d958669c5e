"""Re-placed home experts on real token-level routing: python -m benchmarks.homes [--quick]

The ESFT token traces of DeepSeek-V2-Lite (64 experts, top-6, 26 MoE layers) split by prompt into two
windows. A placement is learned on the first window's loads and co-activation
(jtopoep.homes.replace_homes, from contiguous homes) and measured on the second, as in training,
where each re-placement serves the steps after it. Each rank gets 4096 tokens of whole prompts of the
second window (benchmarks.data_path.token_batch); per layer and placement:

- scale-out token rows per token with the deduplicated dispatch (jtopoep.relay) against flat pairs
  across nodes (the same under any placement when sources are alike: reported, not a target);
- home-only imbalance (max / mean, before any copy) of rank loads and of node loads;
- the plan of `none` (home experts only), of eplb and of topoep (K = 2, pricing on): imbalance
  after, guest copies, and the cost model's layer time by term (jtopoep.costmodel.layer_time with
  the relays' rows), H800 links, DeepSeek-V2-Lite experts;
- inter-node bytes, flat and deduplicated, against eplb's flat exchange on contiguous homes (token
  rows out and back, guest weights out and gradients back: benchmarks.data_path's comparison);
- the migration a re-placement costs (jtopoep.costmodel.migration_seconds: weights and AdamW moments,
  float32), once, and amortised over 100 steps;
- consecutive re-placements (prompts in thirds): what the second moves, and how it does on the third.

Writes benchmarks/results/homes.json and homes.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.data_path import EXPERTS, SLOTS, TOKENS, TOPOLOGIES, inter_bytes, scaleout, token_batch
from benchmarks.planners import DIMS, make
from jtopoep import traces, xla_cpu
from jtopoep.costmodel import layer_time, migration_seconds
from jtopoep.homes import coactivation, replace_homes
from jtopoep.plan import contiguous_placement, home_rank_of_experts

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PLACEMENTS = ("contiguous", "re-placed")
AMORTISED_OVER = 100
PLANNERS = ("none", "eplb", "topoep")


_replace = jax.jit(replace_homes, static_argnums=3)


def window_statistics(ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(loads [E], co-activation [E, E]) of a window's tokens [T, k], as a layer averages them."""
    return (jnp.asarray(np.bincount(ids.reshape(-1), minlength=EXPERTS), jnp.float32),
            jnp.asarray(coactivation(jnp.asarray(ids), EXPERTS), jnp.float32))


def learned_placement(task: str, layer: int, topology, prompts: range) -> np.ndarray:
    """The placement re-placement computes from the window's loads and co-activation."""
    expert_ids, start = traces.load_esft_tokens(task)
    ids = expert_ids[start[prompts.start]:start[prompts.stop], layer]
    return np.asarray(_replace(*window_statistics(ids), contiguous_placement(topology.num_ranks, EXPERTS), topology))


def home_imbalance(counts: np.ndarray, placement: np.ndarray, gpus: int) -> tuple[float, float]:
    rank = counts.sum(0)[placement].sum(1).astype(np.float64)
    node = rank.reshape(-1, gpus).sum(1)
    return float(rank.max() / rank.mean()), float(node.max() / node.mean())


def measure(topo_name: str, topology, task: str, layers: range, seeds: int, planner_name: str, planner) -> list[dict]:
    _, start = traces.load_esft_tokens(task)
    half = (len(start) - 1) // 2
    learn, test = range(0, half), range(half, len(start) - 1)
    batches = [token_batch(task, topology.num_ranks, seed, test) for seed in range(seeds)]
    out = []
    for layer in layers:
        placements = {"contiguous": np.asarray(contiguous_placement(topology.num_ranks, EXPERTS)),
                      "re-placed": learned_placement(task, layer, topology, learn)}
        row = {"topology": topo_name, "task": task, "planner": planner_name, "layer": layer}
        moved = home_rank_of_experts(placements["contiguous"], np) != home_rank_of_experts(placements["re-placed"], np)
        row["experts_moved"] = int(moved.sum())
        row["migration_s"] = migration_seconds(placements["contiguous"], placements["re-placed"], topology, DIMS)
        for name, placement in placements.items():
            acc = {"pairs": 0, "rows": 0, "across": 0, "rank_home": 0.0, "node_home": 0.0, "after": 0.0, "copies": 0,
                   "weights_s": 0.0, "exchange_s": 0.0, "gemm_s": 0.0, "total_s": 0.0}
            for batch in batches:
                ids = batch[:, :, layer]
                counts = np.stack([np.bincount(r.reshape(-1), minlength=EXPERTS) for r in ids]).astype(np.int32)
                plan = jax.device_get(planner(jnp.asarray(counts), jnp.asarray(placement)))
                got = scaleout(ids, plan, topology, placement)
                rank_home, node_home = home_imbalance(counts, placement, topology.gpus_per_node)
                loads = np.asarray(plan.route).sum((0, 2))
                terms = layer_time(plan, topology, DIMS, placement, node_rows=got["node_rows"])
                acc["pairs"] += got["pairs"]
                acc["rows"] += got["rows"]
                acc["across"] += got["weights"]
                acc["rank_home"] += rank_home / seeds
                acc["node_home"] += node_home / seeds
                acc["after"] += float(loads.max() / loads.mean()) / seeds
                acc["copies"] += int((np.asarray(plan.slot_expert)[:, placement.shape[1]:] >= 0).sum())
                for key in ("weights_s", "exchange_s", "gemm_s", "total_s"):
                    acc[key] += terms[key] / seeds
            tokens = seeds * topology.num_ranks * TOKENS
            row[name] = {"pairs_per_token": acc["pairs"] / tokens, "rows_per_token": acc["rows"] / tokens,
                         "rows_vs_pairs": acc["rows"] / max(acc["pairs"], 1), "rank_home_imbalance": acc["rank_home"],
                         "node_home_imbalance": acc["node_home"], "topoep_imbalance": acc["after"],
                         "topoep_copies": acc["copies"] / seeds, "copies_across_nodes": acc["across"] / seeds,
                         **{key: acc[key] for key in ("weights_s", "exchange_s", "gemm_s", "total_s")}}
        out.append(row)
        c, r = row["contiguous"], row["re-placed"]
        print(f"{topo_name} {task} {planner_name} layer {layer}: rows/pairs {c['rows_vs_pairs']:.2f} -> {r['rows_vs_pairs']:.2f}, "
              f"node home {c['node_home_imbalance']:.2f} -> {r['node_home_imbalance']:.2f}, "
              f"copies {c['topoep_copies']:.0f} -> {r['topoep_copies']:.0f}, moved {row['experts_moved']}", flush=True)
    return out


def stability(topo_name: str, topology, task: str, layers: range) -> dict:
    """Consecutive re-placements: the prompts in thirds; a placement learned on the first (from
    contiguous homes), re-placed from it on the second; the experts the second moves, within and
    across nodes, and the distinct nodes per token on the third (home experts only)."""
    expert_ids, start = traces.load_esft_tokens(task)
    cuts = [start[(len(start) - 1) * i // 3] for i in range(4)]
    gpus = topology.gpus_per_node
    moved, across, distinct = [], [], []
    for layer in layers:
        windows = [expert_ids[cuts[i]:cuts[i + 1], layer] for i in range(3)]
        first = _replace(*window_statistics(windows[0]), contiguous_placement(topology.num_ranks, EXPERTS), topology)
        second = _replace(*window_statistics(windows[1]), first, topology)
        before, after = home_rank_of_experts(np.asarray(first), np), home_rank_of_experts(np.asarray(second), np)
        moved.append(int((before != after).sum()))
        across.append(int((before // gpus != after // gpus).sum()))
        nodes = (after // gpus)[windows[2]]
        distinct.append(float(np.mean([len(set(t)) for t in nodes])))
    return {"topology": topo_name, "task": task, "moved": float(np.mean(moved)), "moved_across": float(np.mean(across)),
            "distinct_nodes_per_token": float(np.mean(distinct)), "top_k": int(expert_ids.shape[-1])}


def summary(rows: list[dict]) -> list[dict]:
    """Per topology and task: rows and pairs summed over layers, imbalances and times averaged."""
    out = []
    for key in sorted({(r["topology"], r["task"], r["planner"]) for r in rows}):
        group = [r for r in rows if (r["topology"], r["task"], r["planner"]) == key]
        entry = {"topology": key[0], "task": key[1], "planner": key[2], "experts_moved": float(np.mean([r["experts_moved"] for r in group])),
                 "migration_s": float(np.mean([r["migration_s"] for r in group]))}
        for name in PLACEMENTS:
            parts = [r[name] for r in group]
            entry[name] = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}
            entry[name]["rows_vs_pairs"] = (sum(p["rows_per_token"] for p in parts)
                                            / sum(p["pairs_per_token"] for p in parts))
            entry[name]["worst_layer_rows_vs_pairs"] = max(p["rows_vs_pairs"] for p in parts)
        out.append(entry)
    # Inter-node bytes per layer against eplb's flat exchange on contiguous homes (benchmarks.data_path's
    # comparison): token rows out and back, and guest weights out and gradients back.
    eplb = {(e["topology"], e["task"]): e["contiguous"] for e in out if e["planner"] == "eplb"}
    for entry in out:
        if (entry["topology"], entry["task"]) not in eplb:
            continue
        tokens = TOPOLOGIES[entry["topology"]].num_ranks * TOKENS
        flat = eplb[entry["topology"], entry["task"]]
        base = inter_bytes(flat["pairs_per_token"] * tokens, flat["copies_across_nodes"])
        for name in PLACEMENTS:
            p = entry[name]
            p["flat_bytes_vs_eplb_flat"] = inter_bytes(p["pairs_per_token"] * tokens, p["copies_across_nodes"]) / base
            p["dedup_bytes_vs_eplb_flat"] = inter_bytes(p["rows_per_token"] * tokens, p["copies_across_nodes"]) / base
    return out


def markdown(rows: list[dict], totals: list[dict], stable: list[dict], layers: range, seeds: int) -> str:
    ms = 1e3
    lines = ["# Re-placed home experts on real token-level routing", "",
             f"`python -m benchmarks.homes` (ESFT token traces of DeepSeek-V2-Lite, layers {list(layers)}: placement "
             f"learned on the first half of the prompts, measured on {seeds} draw(s) of {TOKENS} tokens per rank from "
             f"the second; K = {SLOTS}, pricing on; DeepSeek-V2-Lite experts on H800 links).", "",
             "## Per trace (means over layers; rows / pairs over all layers)", "",
             "| topology | trace | planner | homes | flat pairs / token | dedup rows / token | rows / pairs | worst layer | "
             "rank home imb. | node home imb. | imb. after | copies | across nodes | flat bytes / eplb flat | "
             "dedup bytes / eplb flat | weights ms | exchange ms | layer ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in totals:
        for name in PLACEMENTS:
            p = t[name]
            lines.append(f"| {t['topology']} | {t['task']} | {t['planner']} | {name} | {p['pairs_per_token']:.2f} | "
                         f"{p['rows_per_token']:.2f} | {p['rows_vs_pairs']:.3f} | {p['worst_layer_rows_vs_pairs']:.2f} | "
                         f"{p['rank_home_imbalance']:.2f} | {p['node_home_imbalance']:.2f} | {p['topoep_imbalance']:.2f} | "
                         f"{p['topoep_copies']:.1f} | {p['copies_across_nodes']:.1f} | {p['flat_bytes_vs_eplb_flat']:.2f} | "
                         f"{p['dedup_bytes_vs_eplb_flat']:.2f} | {p['weights_s'] * ms:.3f} | {p['exchange_s'] * ms:.3f} | "
                         f"{p['total_s'] * ms:.3f} |")
    lines += ["", "## Migration per re-placement (means over layers)", "",
              f"| topology | trace | experts moved | seconds, once | ms per step over {AMORTISED_OVER} steps |",
              "|---|---|---|---|---|"]
    lines += [f"| {t['topology']} | {t['task']} | {t['experts_moved']:.1f} | {t['migration_s']:.4f} | "
              f"{t['migration_s'] / AMORTISED_OVER * ms:.3f} |" for t in totals if t["planner"] == PLANNERS[0]]
    lines += ["", "## Consecutive re-placements (means over layers)", "",
              "Prompts in thirds: a placement learned on the first, re-placed from it on the second; what the second "
              "moves, and the distinct nodes per token it gives on the third (home experts only).", "",
              "| topology | trace | experts moved | across nodes | distinct nodes per token / k |", "|---|---|---|---|---|"]
    lines += [f"| {t['topology']} | {t['task']} | {t['moved']:.1f} of {EXPERTS} | {t['moved_across']:.1f} | "
              f"{t['distinct_nodes_per_token']:.2f} / {t['top_k']} |" for t in stable]
    lines += ["", "## Dedup rows / flat pairs per layer", "",
              "| topology | trace | planner | layer | contiguous | re-placed |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['topology']} | {r['task']} | {r['planner']} | {r['layer']} | {r['contiguous']['rows_vs_pairs']:.3f} | "
              f"{r['re-placed']['rows_vs_pairs']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every 5th layer, one draw, 4 x 8 only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    xla_cpu.configure()
    layers = range(0, 26, 5) if args.quick else range(26)
    seeds = 1 if args.quick else 2
    topologies = {"4x8": TOPOLOGIES["4x8"]} if args.quick else TOPOLOGIES
    rows = []
    for topo_name, topology in topologies.items():
        for name in PLANNERS:
            planner = jax.jit(make(name, topology, EXPERTS, SLOTS, 0.0))
            for task in traces.ESFT_TASKS:
                rows += measure(topo_name, topology, task, layers, seeds, name, planner)
    totals = summary(rows)
    stable = [stability(name, topology, task, layers) for name, topology in topologies.items()
              for task in traces.ESFT_TASKS]
    result = {"rows": rows, "summary": totals, "stability": stable, "layers": list(layers), "seeds": seeds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "homes.json").write_text(json.dumps(result, indent=1))
    (args.out / "homes.md").write_text(markdown(rows, totals, stable, layers, seeds))
    return result


if __name__ == "__main__":
    main()
