"""The plan: which expert each slot holds and how many pairs each source sends to each slot.

A Plan is a fixed-shape pytree of int32 arrays, so it can be computed inside jit and shard_map and
all-gathered like any other value. Slots [0, H) of a rank hold its home experts (the placement),
slots [H, S) are guest slots holding a copy of another rank's expert, or -1 when empty.

Which concrete pair goes where: on source s, the pairs for expert e, in their order in the flattened
[T, k] routing, fill the slots holding e in ascending (d, j) order, route[s, d, j] pairs each.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int


class Plan(NamedTuple):
    slot_expert: Int[Array, "R S"]  # expert held by slot (d, j); -1 for an empty guest slot
    route: Int[Array, "R R S"]  # route[s, d, j]: pairs from source s processed in slot j of rank d

    @property
    def num_ranks(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[1]


def contiguous_placement(num_ranks: int, num_experts: int) -> Int[Array, "R H"]:
    """Home expert of each home slot: rank r holds experts [r*H, (r+1)*H)."""
    if num_experts % num_ranks:
        raise ValueError(f"num_experts = {num_experts} must be a multiple of num_ranks = {num_ranks}")
    return jnp.arange(num_experts, dtype=jnp.int32).reshape(num_ranks, num_experts // num_ranks)


def home_rank_of_experts(placement: Int[ArrayLike, "R H"], xp=jnp) -> Int[ArrayLike, " E"]:
    """[E] home rank of each expert under the placement (a permutation of the experts): a scatter,
    as jnp or numpy arrays (xp)."""
    num_ranks, home = placement.shape
    ranks = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), home)
    if xp is np:
        out = np.zeros(num_ranks * home, np.int32)
        out[np.asarray(placement).reshape(-1)] = ranks
        return out
    return jnp.zeros(num_ranks * home, jnp.int32).at[placement.reshape(-1)].set(ranks, unique_indices=True)


def home_plan(counts: Int[Array, "R E"], placement: Int[Array, "R H"], guest_slots: int) -> Plan:
    """Every pair goes to its expert's home slot; guest slots stay empty (the 'none' planner)."""
    num_ranks = counts.shape[0]
    # Gathered by the flat placement: indexing by the [R, H] array itself, XLA:CPU gave the route
    # a transposed layout and copied it (9 ms at 1024 ranks against 0.7).
    home_route = counts[:, placement.reshape(-1)].reshape(num_ranks, num_ranks, -1).astype(jnp.int32)  # [s, d, h]
    slot_expert = jnp.pad(placement.astype(jnp.int32), ((0, 0), (0, guest_slots)), constant_values=-1)
    route = jnp.pad(home_route, ((0, 0), (0, 0), (0, guest_slots))) if guest_slots else home_route
    return Plan(slot_expert, route)


def rank_loads(plan: Plan) -> Int[Array, " R"]:
    """Pairs processed by each rank: load[d] = route[:, d, :].sum()."""
    return plan.route.sum(axis=(0, 2))


def check_plan(plan: Plan, counts, placement=None) -> None:
    """Raise ValueError naming the first broken invariant of the plan, with the offending indices.

    Invariants: (1) no expert twice on a rank, guest ids in [0, E) or -1, home slots equal the
    placement; (2) route >= 0 and nothing routed into an empty slot; (3) conservation: for every
    source s and expert e, the pairs routed to slots holding e equal counts[s, e].
    """
    slot_expert = np.asarray(plan.slot_expert)
    route = np.asarray(plan.route)
    counts = np.asarray(counts)
    num_ranks, num_experts = counts.shape
    if placement is None:
        placement = np.arange(num_experts).reshape(num_ranks, -1)
    placement = np.asarray(placement)
    home = placement.shape[1]
    if slot_expert.ndim != 2 or slot_expert.shape[0] != num_ranks or slot_expert.shape[1] < home:
        raise ValueError(f"slot_expert has shape {slot_expert.shape}; expected ({num_ranks}, S >= {home})")
    num_slots = slot_expert.shape[1]
    if route.shape != (num_ranks, num_ranks, num_slots):
        raise ValueError(f"route has shape {route.shape}; expected {(num_ranks, num_ranks, num_slots)}")
    if not np.array_equal(slot_expert[:, :home], placement):
        d, j = np.argwhere(slot_expert[:, :home] != placement)[0]
        raise ValueError(f"home slot (rank {d}, slot {j}) holds expert {slot_expert[d, j]}, "
                         f"but the placement puts expert {placement[d, j]} there")
    bad = (slot_expert < -1) | (slot_expert >= num_experts)
    if bad.any():
        d, j = np.argwhere(bad)[0]
        raise ValueError(f"guest slot (rank {d}, slot {j}) holds expert id {slot_expert[d, j]}; "
                         f"expected -1 or an id in [0, {num_experts})")
    for d in range(num_ranks):
        held = slot_expert[d][slot_expert[d] >= 0]
        ids, times = np.unique(held, return_counts=True)
        if (times > 1).any():
            raise ValueError(f"rank {d} holds expert {ids[times > 1][0]} in more than one slot")
    if (route < 0).any():
        s, d, j = np.argwhere(route < 0)[0]
        raise ValueError(f"route[{s}, {d}, {j}] = {route[s, d, j]} is negative")
    into_empty = (route > 0) & (slot_expert[None] < 0)
    if into_empty.any():
        s, d, j = np.argwhere(into_empty)[0]
        raise ValueError(f"route[{s}, {d}, {j}] = {route[s, d, j]} sends pairs into an empty slot")
    routed = np.zeros((num_ranks, num_experts), np.int64)
    for d in range(num_ranks):
        for j in range(num_slots):
            if slot_expert[d, j] >= 0:
                routed[:, slot_expert[d, j]] += route[:, d, j]
    if not np.array_equal(routed, counts):
        s, e = np.argwhere(routed != counts)[0]
        raise ValueError(f"pairs from source {s} to expert {e} are not conserved: the plan routes "
                         f"{routed[s, e]}, the counts have {counts[s, e]}")


def plan_fingerprint(plan: tuple) -> Int[Array, ""]:
    """An int32 digest of every entry of a plan's two int arrays (a Plan, or the slots and quotas a
    planner decides), each weighted by a mix of its index, wrapping uint32 arithmetic: equal on every
    device exactly when their plans are, up to collisions."""
    parts = []
    for offset, array in enumerate(plan):
        flat = array.reshape(-1).astype(jnp.uint32) + jnp.uint32(1)
        index = jnp.arange(flat.shape[0], dtype=jnp.uint32) + jnp.uint32(offset << 28)
        mix = (index ^ (index >> 16)) * jnp.uint32(0x45D9F3B)
        parts.append((flat * (mix ^ (mix >> 16))).sum(dtype=jnp.uint32))
    return jax.lax.bitcast_convert_type(parts[0] * jnp.uint32(0x9E3779B1) + parts[1], jnp.int32)



class GuestFetch(NamedTuple):
    """How guest weights travel (guest_fetch): who sends each guest slot its copy, which copies each
    rank sends across for their home (handed over NVLink), and which it receives from across for
    the holders of its node (passed on over NVLink)."""
    source: Int[ArrayLike, "R K"]  # the rank guest slot (d, i) gets its weights from; -1: nothing sent
    staged: Int[ArrayLike, "R K"]  # experts rank r sends across for their home (from its home); -1 none
    received: Int[ArrayLike, "R K"]  # experts rank r receives from across for its node's holders; -1 none
    received_from: Int[ArrayLike, "R K"]  # the rank across that sends each of them; -1 none


def _scatter_set(size: int, index, values, where, xp):
    """full(size, -1) with values written at index where `where`; each index written at most once."""
    index = xp.where(where, index, size)
    if xp is np:
        out = np.full(size + 1, -1, np.int32)
        out[index] = values
        return out[:size]
    return jnp.full(size, -1, jnp.int32).at[index].set(values.astype(jnp.int32), mode="drop")


def _count(rank, where, num_ranks: int, xp):
    """[R] how many of the entries `where` fall on each rank."""
    rank = xp.where(where, rank, num_ranks)
    if xp is np:
        return np.bincount(rank, minlength=num_ranks + 1)[:num_ranks].astype(np.int32)
    return jnp.zeros(num_ranks + 1, jnp.int32).at[rank].add(1)[:num_ranks]


def _spread_over_links(rank, before, crossing, num_ranks: int, gpus_per_node: int, rows: int, xp):
    """Crossings spread over their node's G scale-out links: each `crossing` entry falls on `rank`,
    `before` of that rank's crossings ahead of it. A rank keeps up to its node's share,
    ceil(crossings of the node / G); the j-th of the node's crossings past the ranks' shares goes
    to the rank whose free interval (share - kept, at most `rows` staging rows) holds j, and past
    them all stays where it was. Returns ([n] moved, [n] new rank, [n] its staging row)."""
    per_node = _count(rank, crossing, num_ranks, xp).reshape(-1, gpus_per_node)
    share = -(-per_node.sum(1, keepdims=True) // gpus_per_node)  # [N, 1]
    kept = xp.minimum(per_node, share)
    free = xp.minimum(share - kept, rows)  # a rank with more than its share has none
    excess = per_node - kept
    excess_before = (xp.cumsum(excess, axis=1) - excess).reshape(-1)
    free_end = xp.cumsum(free, axis=1)  # [N, G]
    node = rank // gpus_per_node
    extra = before - kept.reshape(-1)[rank]  # >= 0: past the rank's share
    j = excess_before[rank] + extra
    lane = (free_end[node] <= j[:, None]).sum(1)
    moved = crossing & (extra >= 0) & (lane < gpus_per_node)
    target = (node * gpus_per_node + xp.minimum(lane, gpus_per_node - 1)).astype(xp.int32)
    return moved, target, j - (free_end.reshape(-1)[target] - free.reshape(-1)[target])


def fetch_send_rows(num_ranks: int, home: int, num_guests: int, gpus_per_node: int) -> tuple[int, int, int, int]:
    """The most rows one rank sends in each of the fetch's four exchanges (its send buffers, each a
    [rows, slice of whole experts] array), from guest_fetch's rules (jtopoep.guests runs them):
    1. a home hands crossings only to its G - 1 peers, at most K staging rows each, and never more
       than its experts' crossings, H (N - 1);
    2. a home sends to at most the G K slots of its node;
    3. a rank sends at most H (N - 1) crossings: a home past its node's share receives no hand-offs,
       and one within it sends at most the share;
    4. a receiver passes copies to at most the G K slots of its node."""
    nodes, all_slots = num_ranks // gpus_per_node, num_ranks * num_guests
    crossings = home * (nodes - 1)
    return (min(all_slots, crossings, (gpus_per_node - 1) * num_guests),
            min(all_slots, gpus_per_node * num_guests),
            min(all_slots, crossings),
            min(all_slots, gpus_per_node * num_guests))


def guest_fetch(guests: Int[ArrayLike, "R K"], placement: Int[ArrayLike, "R H"], gpus_per_node: int,
                sent: Bool[ArrayLike, "R K"] | None = None, xp=jnp) -> GuestFetch:
    """The fan-out fetch of the guest weights (jtopoep.guests; numpy or jnp, xp), for the slots
    `sent` (default every non-empty one):
    - a copy on its expert's home node comes from the home over NVLink;
    - each other node holding copies gets one across ("a crossing"), which its first slot holding
      the expert (in (rank, slot) order) receives and passes on to the node's other holders over
      NVLink;
    - crossings are spread over the links at both ends (_spread_over_links): a home sends up to its
      node's share across and hands the rest over NVLink to peers below the share, which send them
      for it; a first holder receives up to its node's share and the rest go to peers below it,
      which pass them on to the holders. So a hot expert wanted on many nodes does not queue on its
      home's one link, nor two copies on one receiving link.
    Gradients go back up the same tree, summed on the way."""
    num_ranks, slots = guests.shape
    none = xp.full((num_ranks, slots), -1, xp.int32)
    if slots == 0:
        return GuestFetch(none, none, none, none)
    count = num_ranks * slots
    flat = guests.reshape(-1)
    sent = (flat >= 0) if sent is None else (sent.reshape(-1) & (flat >= 0))
    home = home_rank_of_experts(placement, xp)[xp.maximum(flat, 0)]
    index = xp.arange(count, dtype=xp.int32)
    node = index // slots // gpus_per_node
    # The first holder of each slot's expert on its node: the first sent slot there holding it.
    same = (flat[:, None] == flat[None, :]) & (node[:, None] == node[None, :]) & sent[None, :]
    first = xp.argmax(same, axis=1).astype(xp.int32)
    home_node = home // gpus_per_node
    crossing = sent & (first == index) & (home_node != node)
    # Sending side: each home's crossings in slot order.
    before = (crossing[None, :] & (home[None, :] == home[:, None]) & (index[None, :] < index[:, None])).sum(1)
    handed, peer, row = _spread_over_links(home, before, crossing, num_ranks, gpus_per_node, slots, xp)
    sender = xp.where(handed, peer, home)
    # Receiving side: each first holder's crossings in slot order.
    holder = index // slots
    mine = crossing.reshape(num_ranks, slots)
    before = (xp.cumsum(mine, axis=1) - mine).reshape(-1)
    moved, relay, row_in = _spread_over_links(holder, before, crossing, num_ranks, gpus_per_node, slots, xp)
    relay = xp.where(moved, relay, holder)
    source = xp.where(home_node == node, home,
                      xp.where((first == index) & ~moved, sender, relay[first]))
    shape = (num_ranks, slots)
    return GuestFetch(xp.where(sent, source, -1).reshape(shape).astype(xp.int32),
                      _scatter_set(count, peer * slots + row, flat, handed, xp).reshape(shape),
                      _scatter_set(count, relay * slots + row_in, flat, moved, xp).reshape(shape),
                      _scatter_set(count, relay * slots + row_in, sender, moved, xp).reshape(shape))
