"""The scale-out data path on real token-level routing: python -m benchmarks.data_path [--quick]

Two tables, for each planner at 4 x 8 and 2 x 4 H800 GPUs (DeepSeek-V2-Lite experts, K = 2 guest
slots, bfloat16):

- Rows across nodes. The ESFT token-level traces (each token's 6 experts at each of the 26 MoE layers
  of DeepSeek-V2-Lite) replayed whole: each rank gets whole prompts, drawn with replacement, up to
  4096 tokens (one sequence of the model's length per GPU). The plan's rule assigns each pair to a
  slot (jtopoep.dispatch.assign_slots); scale-out token rows per token are counted flat (every pair
  bound for another node) and deduplicated (jtopoep.relay: every other node a token reaches, once).
  Inter-node bytes add the guest weights that cross nodes (fan-out fetch, jtopoep.costmodel), both
  ways: tokens out and back, weights out and gradients back. The cost model's exchange time of the
  slowest rank, relay (scale-out rows, then NVLink pairs) against flat, summed over the layers.
- Drops against the receive-buffer capacity factor (moe.recv_capacity_factor): the pairs each plan
  loses when every rank's receive buffer, and every relay's, holds factor x T x k rows (the cuts of
  jtopoep.rank_route.cut_columns and cut_relays), on the same real traces and on the
  synthetic families of benchmarks.scale; and the factor each planner would need to drop nothing.

Writes benchmarks/results/data_path.json and data_path.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.planners import DIMS, make
from benchmarks.scale import loads as synthetic_loads
from jtopoep import traces, xla_cpu
from jtopoep.costmodel import exchange_seconds_per_rank, guest_transfers, relay_exchange_seconds_per_rank
from jtopoep.dispatch import assign_slots
from jtopoep.plan import Plan, contiguous_placement
from jtopoep.rank_route import cut_columns, cut_relays
from jtopoep.topology import Topology

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PLANNERS = ("none", "eplb", "topoep", "taot")
TOPOLOGIES = {"4x8": Topology.preset("h800-4x8"), "2x4": Topology(2, 4)}
TOKENS, EXPERTS, TOP_K, SLOTS = 4096, 64, 6, 2
FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)
SYNTHETIC = ("zipf-1.0", "lognormal", "hot-node", "bursts")


def token_batch(task: str, num_ranks: int, seed: int, prompts: range | None = None) -> np.ndarray:
    """int32 [R, T, layers, k]: each rank's tokens, whole prompts drawn with replacement (from
    `prompts`, default all)."""
    expert_ids, start = traces.load_esft_tokens(task)
    prompts = range(len(start) - 1) if prompts is None else prompts
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_ranks):
        rows = []
        while sum(len(r) for r in rows) < TOKENS:
            sample = prompts[rng.integers(len(prompts))]
            rows.append(np.arange(start[sample], start[sample + 1]))
        out.append(expert_ids[np.concatenate(rows)[:TOKENS]])
    return np.stack(out)


@jax.jit
def _destinations(ids, plan):
    """int32 [R, T * k]: each pair's flat destination slot d * S + j under the plan's rule."""
    num_experts = EXPERTS
    counts = jax.vmap(lambda i: jnp.zeros(num_experts, jnp.int32).at[i].add(1))(ids)
    ranks = jnp.arange(ids.shape[0], dtype=jnp.int32)
    return jax.vmap(assign_slots, in_axes=(0, 0, None, 0))(ids, counts, plan.slot_expert, plan.route[ranks])


def _token_nodes(ids: np.ndarray, plan: Plan, gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pair's destination node [R, T, k], whether it is its token's first choice on that node,
    and the distinct (token, node) rows each source sends each node [R, N]."""
    num_ranks, tokens, top_k = ids.shape
    dest = np.asarray(_destinations(jnp.asarray(ids.reshape(num_ranks, -1)), plan))
    dest_node = (dest // plan.slot_expert.shape[1] // gpus).reshape(num_ranks, tokens, top_k)
    first = np.ones(dest_node.shape, bool)
    for i in range(1, top_k):
        first[:, :, i] = (dest_node[:, :, :i] != dest_node[:, :, i:i + 1]).all(-1)
    num_nodes = num_ranks // gpus
    node_rows = np.stack([np.bincount(dest_node[s][first[s]], minlength=num_nodes) for s in range(num_ranks)])
    return dest_node, first, node_rows


def relay_rows(ids: np.ndarray, plan: Plan, gpus: int) -> np.ndarray:
    """[R, N]: the distinct (token, node) rows each source sends each node under the plan."""
    return _token_nodes(ids, plan, gpus)[2]


def scaleout(ids: np.ndarray, plan: Plan, topology: Topology, placement=None) -> dict:
    """Scale-out token rows, flat and deduplicated, and guest copies crossing nodes, for one layer
    (homes: `placement`, default contiguous)."""
    num_ranks = ids.shape[0]
    placement = contiguous_placement(num_ranks, EXPERTS) if placement is None else placement
    gpus = topology.gpus_per_node
    dest_node, first, node_rows = _token_nodes(ids, plan, gpus)
    remote = dest_node != (np.arange(num_ranks) // gpus)[:, None, None]
    moves = guest_transfers(jax.device_get(plan), np.asarray(placement), gpus)
    sender_node, host_node = np.arange(num_ranks)[:, None] // gpus, np.arange(num_ranks)[None, :] // gpus
    return {"pairs": int(remote.sum()), "rows": int((remote & first).sum()), "node_rows": node_rows,
            "weights": int(moves[sender_node != host_node].sum()),
            "flat_s": float(exchange_seconds_per_rank(plan, topology, DIMS).max()),
            "relay_s": float(relay_exchange_seconds_per_rank(plan, node_rows, topology, DIMS).max())}


def inter_bytes(rows: float, copies: float) -> float:
    """Both directions: token rows out and back, weights out and their gradients back."""
    return 2.0 * (rows * DIMS.pair_bytes + copies * DIMS.expert_bytes)


def rows_table(planners: dict, layers: range, seeds: int) -> list[dict]:
    out = []
    for topo_name, topology in TOPOLOGIES.items():
        num_ranks = topology.num_ranks
        for task in traces.ESFT_TASKS:
            batches = [token_batch(task, num_ranks, seed) for seed in range(seeds)]
            totals = {name: {"pairs": 0, "rows": 0, "weights": 0, "tokens": 0, "flat_s": 0.0, "relay_s": 0.0}
                      for name in PLANNERS}
            per_layer = {name: [] for name in PLANNERS}
            for batch in batches:
                for layer in layers:
                    ids = batch[:, :, layer]
                    counts = np.stack([np.bincount(r.reshape(-1), minlength=EXPERTS) for r in ids]).astype(np.int32)
                    for name in PLANNERS:
                        plan = planners[(topo_name, name)](jnp.asarray(counts))
                        got = scaleout(ids, plan, topology)
                        for key in totals[name]:
                            if key != "tokens":
                                totals[name][key] += got[key]
                        totals[name]["tokens"] += num_ranks * TOKENS
                        per_layer[name].append(got["rows"] / max(got["pairs"], 1))
            eplb_flat = inter_bytes(totals["eplb"]["pairs"], totals["eplb"]["weights"])
            for name in PLANNERS:
                t = totals[name]
                out.append({"topology": topo_name, "task": task, "planner": name,
                            "pairs_per_token": t["pairs"] / t["tokens"], "rows_per_token": t["rows"] / t["tokens"],
                            "rows_vs_pairs": t["rows"] / t["pairs"],
                            "worst_layer_rows_vs_pairs": max(per_layer[name]),
                            "copies_across_per_layer": t["weights"] / (len(layers) * seeds),
                            "relay_vs_flat_exchange_s": t["relay_s"] / t["flat_s"],
                            "flat_bytes_vs_eplb_flat": inter_bytes(t["pairs"], t["weights"]) / eplb_flat,
                            "dedup_bytes_vs_eplb_flat": inter_bytes(t["rows"], t["weights"]) / eplb_flat})
                print(f"{topo_name} {task} {name}: {out[-1]['pairs_per_token']:.2f} pairs, "
                      f"{out[-1]['rows_per_token']:.2f} rows per token across nodes "
                      f"({out[-1]['rows_vs_pairs']:.2f}x); bytes vs eplb flat {out[-1]['dedup_bytes_vs_eplb_flat']:.2f}",
                      flush=True)
    return out


def cut(route: np.ndarray, factor: float, gpus: int) -> dict:
    """Pairs dropped when every receive buffer and relay holds factor x T x k rows, and the factor
    that would drop nothing."""
    route = jnp.asarray(route)
    num_ranks, _, num_slots = route.shape
    rows = int(np.ceil(factor * TOKENS * TOP_K))
    by_node = route.reshape(num_ranks, num_ranks // gpus, gpus, num_slots)  # each node's columns
    kept = jax.vmap(lambda columns: cut_relays(cut_columns(columns, rows), rows), in_axes=1, out_axes=1)(by_node)
    # A relay (n, g) forwards the pairs of the sources (n', g) to node n:
    relayed = by_node.reshape(num_ranks // gpus, gpus, num_ranks // gpus, -1).sum((0, 3))  # [g, n]
    needed = max(int(route.sum((0, 2)).max()), int(relayed.max()))
    return {"dropped": int(route.sum() - kept.sum()), "needed": needed / (TOKENS * TOP_K)}


def drops_table(planners: dict, layers: range, seeds: int, steps: int) -> list[dict]:
    out = []
    for topo_name, topology in TOPOLOGIES.items():
        num_ranks, gpus = topology.num_ranks, topology.gpus_per_node
        families = {}
        for task in traces.ESFT_TASKS:
            mats = []
            for seed in range(seeds):
                batch = token_batch(task, num_ranks, seed)
                mats += [np.stack([np.bincount(r.reshape(-1), minlength=EXPERTS) for r in batch[:, :, layer]])
                         for layer in layers]
            families[f"esft-{task}"] = np.stack(mats).astype(np.int32)
        for family in SYNTHETIC:  # scaled to top-6 of 64 experts, as the traces
            mats = synthetic_loads(family, num_ranks, EXPERTS, steps)
            families[family] = np.stack([traces.scale_counts(m, TOKENS * TOP_K) for m in mats]).astype(np.int32)
        for family, mats in families.items():
            for name in PLANNERS:
                routes = [np.asarray(planners[(topo_name, name)](jnp.asarray(c)).route) for c in mats]
                row = {"topology": topo_name, "family": family, "planner": name, "dropped_share": {}}
                for factor in FACTORS:
                    got = [cut(r, factor, gpus) for r in routes]
                    row["dropped_share"][factor] = float(np.mean([g["dropped"] for g in got])) / (num_ranks * TOKENS * TOP_K)
                row["factor_needed_max"] = max(cut(r, FACTORS[-1], gpus)["needed"] for r in routes)
                out.append(row)
                print(f"{topo_name} {family} {name}: needs {row['factor_needed_max']:.2f}, dropped at 1.25: "
                      f"{row['dropped_share'][1.25]:.2%}", flush=True)
    return out


def markdown(rows: list[dict], drops: list[dict], layers: range, seeds: int) -> str:
    lines = ["# The scale-out data path on real token-level routing", "",
             f"`python -m benchmarks.data_path` (ESFT token traces of DeepSeek-V2-Lite, layers {list(layers)}, "
             f"{seeds} draw(s) of {TOKENS} tokens per rank, K = {SLOTS} guest slots, pricing on).", "",
             "## Token rows across nodes, per token", "",
             "| topology | trace | planner | flat pairs | dedup rows | dedup / flat | worst layer | guest copies across a layer | "
             "flat bytes / eplb flat | dedup bytes / eplb flat | exchange time, relay / flat |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['topology']} | {r['task']} | {r['planner']} | {r['pairs_per_token']:.2f} | {r['rows_per_token']:.2f} | "
              f"{r['rows_vs_pairs']:.2f} | {r['worst_layer_rows_vs_pairs']:.2f} | {r['copies_across_per_layer']:.1f} | "
              f"{r['flat_bytes_vs_eplb_flat']:.2f} | {r['dedup_bytes_vs_eplb_flat']:.2f} | "
              f"{r['relay_vs_flat_exchange_s']:.2f} |" for r in rows]
    lines += ["", "## Pairs dropped against moe.recv_capacity_factor (share of all pairs, mean over micro-batches)", "",
              "Every rank's receive buffer and every relay's hold factor x T x k rows; the last column is the "
              "factor the plan would need to drop nothing in its worst micro-batch.", "",
              "| topology | loads | planner | " + " | ".join(f"{f:g}" for f in FACTORS) + " | factor needed |",
              "|---|---|---|" + "---|" * (len(FACTORS) + 1)]
    lines += [f"| {d['topology']} | {d['family']} | {d['planner']} | "
              + " | ".join(f"{d['dropped_share'][f]:.2%}" for f in FACTORS) + f" | {d['factor_needed_max']:.2f} |"
              for d in drops]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every 5th layer, one draw, 2 synthetic micro-batches")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    xla_cpu.configure()
    layers = range(0, 26, 5) if args.quick else range(26)
    seeds = 1 if args.quick else 2
    planners = {(t, name): jax.jit(make(name, topology, EXPERTS, SLOTS, 0.0))
                for t, topology in TOPOLOGIES.items() for name in PLANNERS}
    rows = rows_table(planners, layers, seeds)
    drops = drops_table(planners, layers, seeds, 2 if args.quick else 8)
    result = {"rows": rows, "drops": drops, "layers": list(layers), "seeds": seeds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_path.json").write_text(json.dumps(result, indent=1))
    (args.out / "data_path.md").write_text(markdown(rows, drops, layers, seeds))
    return result


if __name__ == "__main__":
    main()
