"""What a plan does: rank loads and imbalance, traffic by link class, weighted communication cost.

Link classes: 0 same rank (no transfer), 1 intra-node (NVLink), 2 inter-node (InfiniBand).
Token traffic per layer is counted for its four exchanges (dispatch and combine, forward and
backward); guest-weight traffic is weights out plus gradients back. The weighted communication cost
(WCC) is the sum over transfers of bytes x topology.link_cost().
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims, link_class, guest_transfers
from jtopoep.plan import Plan, home_rank_of_experts
from jtopoep.topology import Topology


def load_imbalance(loads: Int[Array, " R"]) -> Float[Array, ""]:
    """max / mean of rank loads (1.0 for an empty micro-batch). Jittable."""
    loads = loads.astype(jnp.float32)
    mean = loads.mean()
    return jnp.where(mean > 0, loads.max() / jnp.maximum(mean, 1e-30), 1.0)


def imbalance(plan: Plan) -> Float[Array, ""]:
    """max / mean of the plan's rank loads. Jittable."""
    return load_imbalance(plan.route.sum(axis=(0, 2)))


def counts_imbalance(counts: Int[Array, "R E"], placement: Int[Array, "R H"]) -> Float[Array, ""]:
    """Imbalance of the home placement before any balancing. Jittable."""
    return load_imbalance(counts.sum(0)[placement].sum(1))


def inter_node_pairs(plan: Plan, gpus_per_node: int) -> Int[Array, ""]:
    """Pairs dispatched across nodes (each also comes back in the combine). Jittable."""
    num_ranks = plan.route.shape[0]
    node = jnp.arange(num_ranks) // gpus_per_node
    across = node[:, None] != node[None, :]
    return jnp.where(across, plan.route.sum(2), 0).sum()


def summarize(plan: Plan, counts, topology: Topology, dims: ExpertDims, placement=None) -> dict[str, float]:
    """Every metric of one plan as a flat dict of Python numbers, ready to log."""
    counts = np.asarray(counts)
    route = np.asarray(plan.route).astype(np.float64)
    num_ranks, num_experts = counts.shape
    if placement is None:
        placement = np.arange(num_experts).reshape(num_ranks, -1)
    placement = np.asarray(placement)
    loads = route.sum(axis=(0, 2))
    total = loads.sum()
    mean = total / num_ranks
    node_loads = loads.reshape(topology.num_nodes, topology.gpus_per_node).sum(1)
    home_loads = counts.sum(0)[placement].sum(1)
    out = {
        "pairs": float(total),
        "max_load": float(loads.max()),
        "imbalance": float(loads.max() / mean) if mean else 1.0,
        "imbalance_before": float(home_loads.max() / mean) if mean else 1.0,
        "imbalance_lower_bound": float(np.ceil(total / num_ranks) / mean) if mean else 1.0,
        "node_imbalance": float(node_loads.max() / node_loads.mean()) if mean else 1.0,
    }
    cls = link_class(topology)
    pairs = route.sum(axis=2)
    moves = guest_transfers(plan, placement, topology.gpus_per_node)
    cost = topology.link_cost().astype(np.float64)
    names = {0: "local", 1: "intra", 2: "inter"}
    for c, name in names.items():
        out[f"{name}_pairs"] = float(pairs[cls == c].sum())
        out[f"{name}_token_bytes"] = float(pairs[cls == c].sum() * dims.pair_bytes * EXCHANGES_PER_LAYER)
        out[f"{name}_guest_copies"] = float(moves[cls == c].sum())
        out[f"{name}_weight_bytes"] = float(moves[cls == c].sum() * dims.expert_bytes * 2)
    out["inter_bytes"] = out["inter_token_bytes"] + out["inter_weight_bytes"]
    out["guest_copies"] = float(moves.sum())
    token_wcc = float((pairs * cost).sum() * dims.pair_bytes * EXCHANGES_PER_LAYER)
    weight_wcc = float((moves * cost).sum() * dims.expert_bytes * 2)
    out["wcc_tokens"] = token_wcc
    out["wcc_weights"] = weight_wcc
    out["wcc"] = token_wcc + weight_wcc
    return out


def inter_bytes_floor(counts, topology: Topology, dims: ExpertDims, guest_slots: int, placement=None) -> float:
    """The fewest inter-node bytes (tokens plus guest weights, as `summarize` counts them) that any
    plan with `guest_slots` guest slots per rank can have for these counts, home experts fixed.

    A pair from a source on node n to an expert homed on another node crosses the scale-out link
    unless a copy of that expert on node n serves it, and that copy's weights and gradients cross it
    instead. So one copy of expert e on node n saves at most share[n, e] pairs' worth of exchanges
    minus one copy's weight traffic, a second copy on the same node saves nothing more, and a node
    has gpus_per_node x guest_slots slots. The floor takes each node's best such savings, ignoring
    balance and every rank's capacity: no planner can go below it, whatever imbalance it accepts."""
    counts = np.asarray(counts, np.float64)
    num_ranks, num_experts = counts.shape
    if placement is None:
        placement = np.arange(num_experts).reshape(num_ranks, -1)
    gpus = topology.gpus_per_node
    home_node = home_rank_of_experts(np.asarray(placement), np) // gpus
    share = counts.reshape(topology.num_nodes, gpus, num_experts).sum(1)  # [N, E]
    crossing = np.where(np.arange(topology.num_nodes)[:, None] != home_node[None, :], share, 0.0)
    token_bytes = dims.pair_bytes * EXCHANGES_PER_LAYER
    savings = np.maximum(crossing * token_bytes - 2.0 * dims.expert_bytes, 0.0)
    best = -np.sort(-savings, axis=1)[:, :gpus * guest_slots]
    return float(crossing.sum() * token_bytes - best.sum())
