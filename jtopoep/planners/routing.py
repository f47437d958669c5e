"""Token routing for given copies and quotas: which source sends how many pairs to each slot.

Per expert, its sources (in rank order) and its slots (in rank order) are laid end to end on two
lines of the same length, the expert's load, and each source sends to each slot the overlap of
their intervals: every slot takes exactly its quota and every pair lands. With locality tiers, each
node first keeps what it can of an expert's pairs on its own slots of that expert (min of its
sources' pairs and its slots' quotas), laid out the same way within the node; the rest crosses.

Node-level [N, E] tables, the sources' [R, E] intervals, the slots' [R x S] intervals, then one
fused pass over the route's [R, R x S] entries for what crosses and one over the [G, G x S] blocks
on its diagonal for what stays in a node: no loop, no search, no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Int

from jtopoep.plan import Plan
from jtopoep.planners.arrays import exclusive_prefix_sum, prefix_sum, scatter_add


def _overlap_of(lo, hi, slot_lo, slot_hi, xp):
    """Length of [lo, hi) inside [slot_lo, slot_hi), for lo <= hi: one clip per end."""
    return (xp.minimum(xp.maximum(hi, slot_lo), slot_hi) - xp.minimum(xp.maximum(lo, slot_lo), slot_hi))


def plan_from_quotas(counts: Int[ArrayLike, "R E"], slot_expert: Int[ArrayLike, "R S"], quota: Int[ArrayLike, "R S"],
                     gpus_per_node: int, tiered: bool, xp=jnp) -> Plan:
    """The plan in which every slot takes exactly its quota. Requires each expert's quotas to sum
    to its load. tiered=False is the topology-oblivious split (sources and slots in rank order)."""
    num_ranks, num_experts = counts.shape
    num_slots = slot_expert.shape[1]
    nodes, gpus = num_ranks // gpus_per_node, gpus_per_node
    counts = counts.astype(xp.int32).reshape(nodes, gpus, num_experts)
    flat_expert = slot_expert.reshape(-1)
    expert = xp.maximum(flat_expert, 0)  # [R S]; an empty slot has quota 0, so it takes nothing
    rank = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), num_slots)
    slot_node, slot_gpu = rank // gpus, rank % gpus
    quota = xp.where(flat_expert >= 0, quota.reshape(-1), 0).astype(xp.int32)
    # Quotas by (node, gpu, expert): each rank holds an expert in at most one slot.
    held = scatter_add((nodes, gpus, num_experts), (slot_node, slot_gpu, expert), quota, xp)
    supply, room = counts.sum(1), held.sum(1)  # [N, E]
    kept = xp.minimum(supply, room) if tiered else xp.zeros_like(supply)  # pairs each node keeps
    # Crossing pairs are laid out node after node: each node's sources give theirs beyond the kept
    # ones (which its first sources in rank order give), each node's slots take theirs likewise.
    source_before = exclusive_prefix_sum(supply - kept, 0, xp)
    slot_before = exclusive_prefix_sum(room - kept, 0, xp)
    source_hi = prefix_sum(counts, 1, xp)  # [N, G, E]: within the node
    source_lo = source_hi - counts
    rest_hi = (source_before[:, None] + source_hi - xp.minimum(source_hi, kept[:, None])).reshape(num_ranks, -1)
    rest_lo = (source_before[:, None] + source_lo - xp.minimum(source_lo, kept[:, None])).reshape(num_ranks, -1)
    # Each slot's interval among its node's slots of its expert: the quotas of the ranks up to its own.
    slot_hi = xp.where(xp.arange(gpus)[None, :] <= slot_gpu[:, None], held[slot_node, :, expert], 0).sum(1)
    slot_lo = slot_hi - quota
    slot_kept = kept[slot_node, expert]
    take_lo, take_hi = xp.minimum(slot_lo, slot_kept), xp.minimum(slot_hi, slot_kept)
    cross_lo = slot_before[slot_node, expert] + slot_lo - take_lo
    cross_hi = slot_before[slot_node, expert] + slot_hi - take_hi
    route = _overlap_of(rest_lo[:, expert], rest_hi[:, expert], cross_lo, cross_hi, xp)  # [R, R S]
    if tiered:
        # The kept pairs, sources giving and slots taking in rank order, only meet within a node:
        # the [G, G x S] blocks on the route's diagonal, each from its own node's rows.
        node_expert = expert.reshape(nodes, 1, gpus * num_slots)
        in_hi = xp.take_along_axis(source_hi, node_expert, axis=2)  # [N, G, G S]
        in_lo = xp.take_along_axis(source_lo, node_expert, axis=2)
        inside = _overlap_of(in_lo, in_hi, take_lo.reshape(nodes, 1, -1), take_hi.reshape(nodes, 1, -1), xp)
        route = route.reshape(nodes, gpus, nodes, gpus * num_slots)
        node = xp.arange(nodes)
        if xp is np:
            route[node, :, node, :] += inside
        else:
            route = route.at[node, :, node, :].add(inside, unique_indices=True, indices_are_sorted=True)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
