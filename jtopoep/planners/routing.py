"""Token routing for given copies and quotas: which source sends how many pairs to each slot.

Per expert, its sources (in rank order) and its slots (in rank order) are laid end to end on two
lines of the same length, the expert's load, and each source sends to each slot the overlap of
their intervals: every slot takes exactly its quota and every pair lands. With locality tiers, each
node first keeps what it can of an expert's pairs on its own slots of that expert (min of its
sources' pairs and its slots' quotas), laid out the same way within the node; the rest crosses.

Prefix-sum tables of [R, E] and one fused pass over the route's [R, R x S] entries: no loop, no
search, no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Int

from jtopoep.plan import Plan
from jtopoep.planners.arrays import overlap, prefix_sum, scatter_add


def _node_prefix(x, gpus_per_node: int, xp):
    """([R, E] inclusive prefix sums over each node's ranks, [N, E] node totals) of x [R, E]. Two
    levels (within nodes, then over the node totals) where one scan over all R ranks takes log2(R)
    passes over the whole table."""
    num_ranks = x.shape[0]
    within = prefix_sum(x.reshape(num_ranks // gpus_per_node, gpus_per_node, -1), 1, xp)
    return within.reshape(num_ranks, -1), within[:, -1]


def plan_from_quotas(counts: Int[ArrayLike, "R E"], slot_expert: Int[ArrayLike, "R S"], quota: Int[ArrayLike, "R S"],
                     gpus_per_node: int, tiered: bool, xp=jnp) -> Plan:
    """The plan in which every slot takes exactly its quota. Requires each expert's quotas to sum
    to its load. tiered=False is the topology-oblivious split (sources and slots in rank order)."""
    num_ranks, num_experts = counts.shape
    num_slots = slot_expert.shape[1]
    counts = counts.astype(xp.int32)
    flat_expert = slot_expert.reshape(-1)
    expert = xp.maximum(flat_expert, 0)
    rank = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), num_slots)
    quota = xp.where(flat_expert >= 0, quota.reshape(-1), 0).astype(xp.int32)
    # [rank, expert] tables: each rank holds an expert in at most one slot.
    held = scatter_add((num_ranks, num_experts), (rank, expert), quota, xp)
    node_source_hi, node_supply = _node_prefix(counts, gpus_per_node, xp)  # [R, E], [N, E]
    node_slot_hi, node_room = _node_prefix(held, gpus_per_node, xp)
    if tiered:
        kept = xp.minimum(node_supply, node_room)  # [N, E] pairs each node keeps of each expert
    else:
        kept = xp.zeros_like(node_supply)
    kept_at = xp.repeat(kept, gpus_per_node, axis=0)  # [R, E]
    # What crosses, laid out over all ranks: each source's pairs beyond the kept ones its node's
    # sources give in rank order (min(prefix, kept) of them up to each source), each slot's quota
    # beyond the kept ones its node's slots take in rank order.
    before = xp.repeat(prefix_sum(node_supply - kept, 0, xp) - (node_supply - kept), gpus_per_node, axis=0)
    rest_hi = before + node_source_hi - xp.minimum(node_source_hi, kept_at)
    rest_lo = before + (node_source_hi - counts) - xp.minimum(node_source_hi - counts, kept_at)
    before = xp.repeat(prefix_sum(node_room - kept, 0, xp) - (node_room - kept), gpus_per_node, axis=0)
    cross_hi = before + node_slot_hi - xp.minimum(node_slot_hi, kept_at)
    cross_lo = before + (node_slot_hi - held) - xp.minimum(node_slot_hi - held, kept_at)
    in_lo = xp.minimum(node_slot_hi - held, kept_at)
    in_hi = xp.minimum(node_slot_hi, kept_at)
    # The tables are computed once (behind a barrier, or XLA would fuse them into every element of
    # the gathers below), then every source (rows) against every slot (columns) in one fused pass.
    # Each [R, E] table is gathered on its own: one gather of the four stacked ran five times slower.
    sources = (rest_lo, rest_hi, node_source_hi - counts, node_source_hi)
    slots = tuple(t[rank, expert][None, :] for t in (cross_lo, cross_hi, in_lo, in_hi))
    if xp is not np:
        sources, slots = jax.lax.optimization_barrier((sources, slots))
    route = overlap(sources[0][:, expert], sources[1][:, expert], slots[0], slots[1], xp)
    if tiered:
        # Within the node, sources give and slots take the kept pairs in rank order.
        rank_node = xp.arange(num_ranks, dtype=xp.int32) // gpus_per_node
        same_node = rank_node[:, None] == (rank // gpus_per_node)[None, :]
        route = route + xp.where(same_node, overlap(sources[2][:, expert], sources[3][:, expert], slots[2], slots[3],
                                                    xp), 0)
    route = xp.where((flat_expert >= 0)[None, :], route, 0)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
