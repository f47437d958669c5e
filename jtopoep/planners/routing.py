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

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Int

from jtopoep.plan import Plan
from jtopoep.planners.arrays import overlap, prefix_sum, scatter_add


def _rows_prefix(x, gpus_per_node: int, within_node: bool, xp):
    """Inclusive prefix sums over the ranks (axis 0) of [R, E]; restarting at each node if asked."""
    if not within_node:
        return prefix_sum(x, 0, xp)
    num_ranks = x.shape[0]
    nodes = num_ranks // gpus_per_node
    return prefix_sum(x.reshape(nodes, gpus_per_node, -1), 1, xp).reshape(num_ranks, -1)


def plan_from_quotas(counts: Int[ArrayLike, "R E"], slot_expert: Int[ArrayLike, "R S"], quota: Int[ArrayLike, "R S"],
                     gpus_per_node: int, tiered: bool, xp=jnp) -> Plan:
    """The plan in which every slot takes exactly its quota. Requires each expert's quotas to sum
    to its load. tiered=False is the topology-oblivious split (sources and slots in rank order)."""
    num_ranks, num_experts = counts.shape
    num_slots = slot_expert.shape[1]
    nodes = num_ranks // gpus_per_node
    counts = counts.astype(xp.int32)
    flat_expert = slot_expert.reshape(-1)
    expert = xp.maximum(flat_expert, 0)
    rank = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), num_slots)
    quota = xp.where(flat_expert >= 0, quota.reshape(-1), 0).astype(xp.int32)
    # [rank, expert] tables: each rank holds an expert in at most one slot.
    held = scatter_add((num_ranks, num_experts), (rank, expert), quota, xp)
    source_hi = prefix_sum(counts, 0, xp)
    if tiered:
        node_supply = counts.reshape(nodes, gpus_per_node, num_experts).sum(1)
        node_room = held.reshape(nodes, gpus_per_node, num_experts).sum(1)
        kept = xp.minimum(node_supply, node_room)  # [N, E] pairs each node keeps of each expert
        kept_at = xp.repeat(kept, gpus_per_node, axis=0)  # [R, E]
        # Within the node, sources give and slots take the kept pairs in rank order.
        node_source_hi = _rows_prefix(counts, gpus_per_node, True, xp)
        node_slot_hi = _rows_prefix(held, gpus_per_node, True, xp)
        node_slot_lo = node_slot_hi - held
        take = xp.clip(kept_at - node_slot_lo, 0, held)  # [R, E] what each slot takes in its node
        # What crosses: each source's pairs beyond its node's kept ones, each slot's quota beyond
        # what it takes in its node, laid out over all ranks.
        given = xp.minimum(node_source_hi, kept_at)  # kept pairs given by a node's sources up to each
        kept_before = prefix_sum(kept, 0, xp) - kept  # [N, E] kept pairs of the nodes before
        rest_hi = source_hi - (xp.repeat(kept_before, gpus_per_node, axis=0) + given)
        rest_lo = rest_hi - (counts - (given - xp.minimum(node_source_hi - counts, kept_at)))
        cross_hi = prefix_sum(held - take, 0, xp)
        cross_lo = cross_hi - (held - take)
    else:
        rest_hi, rest_lo = source_hi, source_hi - counts
        cross_hi = prefix_sum(held, 0, xp)
        cross_lo = cross_hi - held
    # Every source (rows) against every slot (columns): gathers of the tables, one fused pass.
    lo, hi = cross_lo[rank, expert][None, :], cross_hi[rank, expert][None, :]
    route = overlap(rest_lo[:, expert], rest_hi[:, expert], lo, hi, xp)
    if tiered:
        rank_node = xp.arange(num_ranks, dtype=xp.int32) // gpus_per_node
        same_node = rank_node[:, None] == (rank // gpus_per_node)[None, :]
        in_lo = node_slot_lo[rank, expert][None, :]
        in_hi = (node_slot_lo + take)[rank, expert][None, :]
        route = route + xp.where(same_node, overlap(node_source_hi[:, expert] - counts[:, expert],
                                                    node_source_hi[:, expert], in_lo, in_hi, xp), 0)
    route = xp.where((flat_expert >= 0)[None, :], route, 0)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
