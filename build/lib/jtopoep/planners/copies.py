"""The state of a copy-placement loop (one guest copy per step) and the plan it ends in."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jtopoep.plan import Plan, home_rank_of_experts
from jtopoep.planners.common import PlannerBase, carry_like, guest_quotas_to_slots, holds_home, set_entry
from jtopoep.planners.pricing import TransferClock, clock_after_copy, home_exchange_seconds, scale_out_shift
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.planners.swaps import locality_swaps
from jtopoep.topology import Topology


# Guest slots per rank that copy_overshedding counts. Beyond two, a rank's further copies seldom pay
# for their weight transfers (they hide behind the same home-slot GEMMs, and the pricing refuses
# them), yet counted as open slots they kept copies from taking all of a rank's room, so the last
# spills found no rank that could take them at a price (with K = 3 or 4, Mixtral's plans were left
# above the target in benchmarks.cluster). Counting two, a copy into a rank's second slot may fill
# its room at any K, as at K = 2; the further slots still take the copies that pay.
OVERSHED_SLOTS = 2

# Columns of CopyState.ranks: room, slots used, then K guest expert ids, then their K quotas.
_ROOM, _USED, _GUESTS = 0, 1, 2


class CopyState(NamedTuple):
    """The state of a copy-placement loop over C candidate experts (one copy per step).

    Per-rank integers live in one [R, 2 + 2K] array (room, slots used, K guest ids, K quotas) and the
    transfer clock in one [4, R] array (and a constant scalar): each step then updates them with one
    kernel each, where separate arrays cost a kernel apiece (XLA:GPU runs a loop body kernel by
    kernel, and so does XLA:CPU unless jtopoep.xla_cpu lets it compile the whole loop as one)."""
    step: jnp.ndarray  # i32 scalar; set to the loop bound to stop early
    spill: jnp.ndarray  # [C] pairs each candidate still has to shed
    ranks: jnp.ndarray  # [R, 2 + 2K]: room (target - load), used, guests (expert id, -1 empty), quotas
    holds: jnp.ndarray  # [R, C] rank holds the candidate (home or guest)
    clock: TransferClock

    @property
    def room(self):  # [R] pairs each rank can still take below the target (negative: above it)
        return self.ranks[:, _ROOM]

    @property
    def used(self):  # [R] guest slots filled
        return self.ranks[:, _USED]

    @property
    def guests(self):  # [R, K] expert id of each guest slot, -1 empty
        return self.ranks[:, _GUESTS:_GUESTS + self.slots]

    @property
    def quotas(self):  # [R, K] pairs each guest slot takes
        return self.ranks[:, _GUESTS + self.slots:]

    @property
    def slots(self) -> int:
        return (self.ranks.shape[1] - _GUESTS) // 2


def start_copies(counts, placement, cand, spill, target, slots: int, pair_fwd_s: float, pair_xchg_s: float,
                 topology: Topology) -> CopyState:
    num_ranks, num_experts = counts.shape
    rank_loads = counts.sum(0)[placement].sum(1)
    ranks = jnp.concatenate([(target - rank_loads)[:, None], jnp.zeros((num_ranks, 1), jnp.int32),
                             jnp.full((num_ranks, slots), -1, jnp.int32), jnp.zeros((num_ranks, slots), jnp.int32)],
                            axis=1).astype(jnp.int32)
    state = CopyState(jnp.int32(0), spill[cand], ranks, holds_home(home_rank_of_experts(placement)[cand], num_ranks),
                      TransferClock.start(rank_loads.astype(jnp.float32) * pair_fwd_s,
                                          *home_exchange_seconds(counts, placement, topology, pair_xchg_s),
                                          topology.gpus_per_node))
    return carry_like(state, counts)


def make_copy(state: CopyState, e, d, amount, ok, cand, home, link, pair_fwd_s: float, crossing, pair_xchg_s: float
              ) -> CopyState:
    """Put a copy of candidate e on rank d taking `amount` pairs off its home rank, where ok.
    crossing: (e's uncovered pairs from d's node, the home node's share of the rest, whether d is on
    the home's node), for the scale-out exchange the copy shifts (pricing.scale_out_shift)."""
    num_ranks, slots = state.ranks.shape[0], state.slots
    amount = jnp.where(ok, amount, 0)
    at_d = (ok & (jnp.arange(num_ranks) == d))[:, None]
    at_home = (jnp.arange(num_ranks) == home)[:, None]
    column = jnp.arange(state.ranks.shape[1])[None, :]
    used = state.used[d]
    # d's room falls by the amount and the home's rises by it, one more slot is used on d, and d's
    # next free slot takes e and its quota.
    ranks = jnp.where(at_d & (column == _GUESTS + used), cand[e],
                      jnp.where(at_d & (column == _GUESTS + slots + used), amount,
                                state.ranks + jnp.where(column == _ROOM, jnp.where(at_home, amount, 0)
                                                        - jnp.where(at_d, amount, 0), 0)
                                + jnp.where(at_d & (column == _USED), 1, 0)))
    is_e = jnp.arange(state.spill.shape[0]) == e
    return state._replace(
        spill=state.spill - jnp.where(is_e, amount, 0),
        ranks=ranks,
        holds=set_entry(state.holds, (d, e), state.holds[d, e] | ok),
        clock=clock_after_copy(state.clock, home, d, link, amount.astype(jnp.float32) * pair_fwd_s, ok,
                               *(pair_xchg_s * x for x in scale_out_shift(amount.astype(jnp.float32), *crossing))))


def copy_overshedding(state: CopyState, e, d, amount, ok, cand, cand_home, kept, link, pair_fwd_s: float, crossing,
                      pair_xchg_s: float):
    """make_copy of candidate e on rank d taking `amount` pairs (at most e's spill), or more when a
    copy would strand room; returns the state and the pairs the copy takes.

    A copy into d's last free slot that leaves d room strands that room behind a full set of slots.
    When fewer free slots are left on ranks with room than candidates still spill, stranded room is
    what keeps the plan above the target: with one home expert per rank (Mixtral's slices) the room
    sits on the few cold ranks, two slots each, while two dozen experts spill. Then the copy takes
    all of d's room, up to what e's home slot keeps (kept [C]: each candidate's load less its
    spill), and e's home rank gets the difference as room, with its own free slots for the experts
    still spilling. Only when no other candidate of the same home rank still spills, whose spill
    would otherwise be counted twice.
    Slots and scarcity are counted as if a rank had at most OVERSHED_SLOTS guest slots (a copy into
    its second slot or later may take all its room), however many it has.
    cand_home: [C] home rank of each candidate; crossing and pair_xchg_s as make_copy's."""
    need = state.spill[e]
    stranded = state.room[d] - amount  # > 0 only when the copy ends e's spill (amount = need)
    budget = min(state.slots, OVERSHED_SLOTS)
    open_slots = jnp.where(state.room > 0, jnp.maximum(budget - state.used, 0), 0)
    still_spilling = (state.spill > 0).sum() - (need <= amount)
    scarce = open_slots.sum() - open_slots[d] < still_spilling
    others = ((cand_home == cand_home[e]) & (jnp.arange(state.spill.shape[0]) != e) & (state.spill > 0)).any()
    fits = ok & (state.used[d] >= budget - 1) & (stranded > 0) & scarce & ~others
    amount = amount + jnp.where(fits, jnp.minimum(stranded, kept[e]), 0)
    return make_copy(state, e, d, amount, ok, cand, cand_home[e], link, pair_fwd_s, crossing, pair_xchg_s), amount


def finish_plan(planner: PlannerBase, counts, placement, state: CopyState, cand) -> Plan:
    """Locality swaps among the candidates into the slots left (they need expert shapes to be
    priced), then the plan."""
    guests, quotas = state.guests, state.quotas
    if planner.dims is not None:
        guests, quotas = locality_swaps(counts, placement, guests, quotas, cand, planner.topology, planner.dims)
    slot_expert, quota = guest_quotas_to_slots(placement, guests, quotas, counts.sum(0))
    return plan_from_quotas(counts, slot_expert, quota, planner.topology.gpus_per_node, True, jnp, experts=cand,
                            level=planner.level_receive)
