"""Token routing for given copies and quotas: which source sends how many pairs to each slot.

Per expert, its sources (in rank order) and its slots (in rank order) are laid end to end on two
lines of the same length, the expert's load, and each source sends to each slot the overlap of
their intervals: every slot takes exactly its quota and every pair lands. With locality tiers, each
node first keeps what it can of an expert's pairs on its own slots of that expert (min of its
sources' pairs and its slots' quotas): its sources give them in rank order and its slots take them
in proportion to their quotas, so every slot of an expert on a node is fed the same local share. The
rest crosses.

`route_lines` builds the lines once: node-level [N, E] tables and the slots' [R x S] intervals, with
no loop, search or sort. Any block of the route (some nodes' sources against some slots) is then one
pass over the counts it gathers (`route_block`): a rank in the layer derives only
its own row and its node's columns, O(R x S) each, never the [R, R, S] whole. `plan_from_quotas`
writes the whole route, for analysis and tests: one fused pass over its [R, R x S] entries for what
crosses and one over the [G, G x S] blocks on its diagonal for what stays in a node.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from jtopoep.plan import Plan
from jtopoep.planners.arrays import exclusive_prefix_sum, prefix_sum, proportional_floor, scatter_add


def _overlap_of(lo, hi, slot_lo, slot_hi, xp):
    """Length of [lo, hi) inside [slot_lo, slot_hi), for lo <= hi: one clip per end."""
    return (xp.minimum(xp.maximum(hi, slot_lo), slot_hi) - xp.minimum(xp.maximum(lo, slot_lo), slot_hi))


class RouteLines(NamedTuple):
    """Where each slot's and each node's pairs sit on the lines of the experts' pairs. Slots are flat,
    d * S + j; a source's own interval follows from its node's row and the counts
    (_source_intervals), for just the experts a block needs."""
    counts: Int[Array, "R E"]
    source_before: Int[Array, "N E"]  # crossing pairs of each expert the nodes before each node give
    kept: Int[Array, "N E"]  # pairs of each expert each node keeps (0 without tiers)
    slot_expert: Int[Array, " RS"]  # expert of each slot, 0 for an empty one (its quota is 0)
    cross_lo: Int[Array, " RS"]  # the slot's interval on its expert's line of crossing pairs
    cross_hi: Int[Array, " RS"]
    take_lo: Int[Array, " RS"]  # its interval among the pairs its node keeps of its expert
    take_hi: Int[Array, " RS"]


class SlotQuotas(NamedTuple):
    """What a planner decides: the expert in each slot and the pairs each slot takes. The route
    follows from them and the counts (route_lines), the same on every rank."""
    slot_expert: Int[Array, "R S"]  # -1 for an empty guest slot
    quota: Int[Array, "R S"]  # pairs slot (d, j) computes; each expert's quotas sum to its load


def route_lines(counts: Int[ArrayLike, "R E"], slot_expert: Int[ArrayLike, "R S"], quota: Int[ArrayLike, "R S"],
                gpus_per_node: int, tiered: bool, xp=jnp) -> RouteLines:
    """The lines on which every slot takes exactly its quota. Requires each expert's quotas to sum
    to its load. tiered=False is the topology-oblivious split (sources and slots in rank order)."""
    num_ranks, num_experts = counts.shape
    num_slots = slot_expert.shape[1]
    nodes, gpus = num_ranks // gpus_per_node, gpus_per_node
    counts = counts.astype(xp.int32)
    flat_expert = slot_expert.reshape(-1)
    expert = xp.maximum(flat_expert, 0)  # [R S]; an empty slot has quota 0, so it takes nothing
    slot_node = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), num_slots) // gpus
    quota = xp.where(flat_expert >= 0, quota.reshape(-1), 0).astype(xp.int32)
    supply = counts.reshape(nodes, gpus, num_experts).sum(1)  # [N, E]
    room = scatter_add((nodes, num_experts), (slot_node, expert), quota, xp)
    kept = xp.minimum(supply, room) if tiered else xp.zeros_like(supply)  # pairs each node keeps
    # Crossing pairs are laid out node after node: each node's sources give theirs beyond the kept
    # ones (which its first sources in rank order give), each node's slots take theirs likewise.
    source_before = exclusive_prefix_sum(supply - kept, 0, xp)
    slot_before = exclusive_prefix_sum(room - kept, 0, xp)
    # Each slot's interval among its node's slots of its expert: the quotas of the node's slots of
    # that expert on ranks up to its own (a rank holds an expert once), compared within the node.
    by_node = expert.reshape(nodes, 1, gpus * num_slots)
    rank_in_node = xp.arange(gpus * num_slots) // num_slots
    before = (by_node == by_node.transpose(0, 2, 1)) & (rank_in_node[None, :] <= rank_in_node[:, None])[None]
    slot_hi = (before * quota.reshape(nodes, 1, -1)).sum(2).reshape(-1)  # [N, G S, G S] -> [R S]
    slot_lo = slot_hi - quota
    # The node's kept pairs of an expert are shared over its slots of that expert in proportion to
    # their quotas: in rank order the first slot (often the home) would take them all, and a copy
    # beside it, fed from other nodes alone, would set the busiest scale-out receive.
    slot_kept, slot_room = kept[slot_node, expert], room[slot_node, expert]
    take = proportional_floor(slot_kept[None], xp.stack([slot_lo, slot_hi]), slot_room[None], xp)
    take_lo, take_hi = take[0], take[1]
    cross_lo = slot_before[slot_node, expert] + slot_lo - take_lo
    cross_hi = slot_before[slot_node, expert] + slot_hi - take_hi
    return RouteLines(counts, source_before, kept, expert, cross_lo, cross_hi, take_lo, take_hi)


def _source_intervals(lines: RouteLines, nodes, experts, gpus_per_node: int, xp=jnp):
    """(rest_lo, rest_hi, in_lo, in_hi), each [a, G, b]: the intervals of the sources of `nodes` [a]
    for `experts` [b] (None: every node, every expert) on the experts' lines of crossing pairs, and
    among their own node's sources (where the kept pairs are given, in rank order)."""
    num_ranks, num_experts = lines.counts.shape
    block = lines.counts.reshape(num_ranks // gpus_per_node, gpus_per_node, num_experts)
    before, kept = lines.source_before, lines.kept
    if nodes is not None:
        block, before, kept = block[nodes], before[nodes], kept[nodes]
    if experts is not None:
        block, before, kept = block[:, :, experts], before[:, experts], kept[:, experts]
    in_hi = prefix_sum(block, 1, xp)  # [a, G, b]
    in_lo = in_hi - block
    before, kept = before[:, None, :], kept[:, None, :]
    return before + in_lo - xp.minimum(in_lo, kept), before + in_hi - xp.minimum(in_hi, kept), in_lo, in_hi


def route_block(lines: RouteLines, nodes: Int[ArrayLike, " a"], slots: Int[ArrayLike, " b"], gpus_per_node: int,
                num_slots: int, xp=jnp) -> Int[Array, "aG b"]:
    """route[s, d, j] for the sources s of `nodes` (their G ranks each, in rank order) and the flat
    slots d * S + j: what crosses plus, where source and slot share a node, what the node keeps."""
    rest_lo, rest_hi, in_lo, in_hi = _source_intervals(lines, nodes, lines.slot_expert[slots], gpus_per_node, xp)
    crossing = _overlap_of(rest_lo, rest_hi, lines.cross_lo[slots], lines.cross_hi[slots], xp)
    inside = _overlap_of(in_lo, in_hi, lines.take_lo[slots], lines.take_hi[slots], xp)
    same_node = nodes[:, None, None] == (slots // num_slots // gpus_per_node)[None, None, :]
    return (crossing + xp.where(same_node, inside, 0)).reshape(-1, slots.shape[0])


def plan_from_quotas(counts: Int[ArrayLike, "R E"], slot_expert: Int[ArrayLike, "R S"], quota: Int[ArrayLike, "R S"],
                     gpus_per_node: int, tiered: bool, xp=jnp) -> Plan:
    """The plan, with its whole route, in which every slot takes exactly its quota (route_lines)."""
    num_ranks, _ = counts.shape
    num_slots = slot_expert.shape[1]
    nodes, gpus = num_ranks // gpus_per_node, gpus_per_node
    lines = route_lines(counts, slot_expert, quota, gpus_per_node, tiered, xp)
    expert = lines.slot_expert
    rest_lo, rest_hi, in_lo, in_hi = (x.reshape(num_ranks, -1) for x in _source_intervals(
        lines, None, None, gpus_per_node, xp))  # [R, E] each
    route = _overlap_of(rest_lo[:, expert], rest_hi[:, expert], lines.cross_lo, lines.cross_hi, xp)  # [R, R S]
    if tiered:
        # The kept pairs, sources giving and slots taking in rank order, only meet within a node:
        # the [G, G x S] blocks on the route's diagonal, each from its own node's rows.
        node_expert = expert.reshape(nodes, 1, gpus * num_slots)
        in_hi = xp.take_along_axis(in_hi.reshape(nodes, gpus, -1), node_expert, axis=2)  # [N, G, G S]
        in_lo = xp.take_along_axis(in_lo.reshape(nodes, gpus, -1), node_expert, axis=2)
        inside = _overlap_of(in_lo, in_hi, lines.take_lo.reshape(nodes, 1, -1), lines.take_hi.reshape(nodes, 1, -1),
                             xp)
        route = route.reshape(nodes, gpus, nodes, gpus * num_slots)
        node = xp.arange(nodes)
        if xp is np:
            route[node, :, node, :] += inside
        else:
            route = route.at[node, :, node, :].add(inside, unique_indices=True, indices_are_sorted=True)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
