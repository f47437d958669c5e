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



def guest_sources(guests: Int[ArrayLike, "R K"], placement: Int[ArrayLike, "R H"], gpus_per_node: int,
                  sent: Bool[ArrayLike, "R K"] | None = None, xp=jnp) -> Int[ArrayLike, "R K"]:
    """[R, K] the rank that sends each guest slot its expert's weights (-1 for empty slots and those
    not `sent`), as the fan-out fetch does: a copy on its expert's home node comes from the home over
    NVLink; on another node, the home sends one copy across, to that node's first slot holding the
    expert (in (rank, slot) order: the relay), and the relay passes it on over NVLink to the node's
    other holders. Gradients go back up the same tree, summed at each relay. numpy or jnp (xp)."""
    num_ranks, slots = guests.shape
    if slots == 0:
        return xp.zeros((num_ranks, 0), xp.int32)
    flat = guests.reshape(-1)
    if sent is None:
        sent = guests >= 0
    sent = sent.reshape(-1) & (flat >= 0)
    home = home_rank_of_experts(placement, xp)[xp.maximum(flat, 0)]
    node = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), slots) // gpus_per_node
    # The relay of each slot: the first sent slot of the same node holding the same expert.
    same = (flat[:, None] == flat[None, :]) & (node[:, None] == node[None, :]) & sent[None, :]
    relay = xp.argmax(same, axis=1) // slots
    source = xp.where(home // gpus_per_node == node, home, xp.where(relay == xp.arange(flat.shape[0]) // slots,
                                                                     home, relay))
    return xp.where(sent, source, -1).reshape(num_ranks, slots).astype(xp.int32)
