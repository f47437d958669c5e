"""The state of a copy-placement loop (one guest copy per step) and the plan it ends in."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jtopoep.plan import Plan, home_rank_of_experts
from jtopoep.planners.common import PlannerBase, carry_like, guest_quotas_to_slots, holds_home
from jtopoep.planners.pricing import TransferClock, clock_after_copy
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.planners.swaps import locality_swaps


class CopyState(NamedTuple):
    """The state of a copy-placement loop over C candidate experts (one copy per step)."""
    step: jnp.ndarray  # i32 scalar; set to the loop bound to stop early
    spill: jnp.ndarray  # [C] pairs each candidate still has to shed
    room: jnp.ndarray  # [R] pairs each rank can still take below the target
    used: jnp.ndarray  # [R] guest slots filled
    holds: jnp.ndarray  # [R, C] rank holds the candidate (home or guest)
    guests: jnp.ndarray  # [R, K] expert id of each guest slot, -1 empty
    quotas: jnp.ndarray  # [R, K] pairs each guest slot takes
    clock: TransferClock


def start_copies(counts, placement, cand, spill, target, slots: int, pair_fwd_s: float) -> CopyState:
    num_ranks, num_experts = counts.shape
    rank_loads = counts.sum(0)[placement].sum(1)
    state = CopyState(
        jnp.int32(0), spill[cand], jnp.maximum(target - rank_loads, 0), jnp.zeros(num_ranks, jnp.int32),
        holds_home(home_rank_of_experts(placement)[cand], num_ranks), jnp.full((num_ranks, slots), -1, jnp.int32),
        jnp.zeros((num_ranks, slots), jnp.int32),
        TransferClock(jnp.zeros(num_ranks), jnp.zeros(num_ranks), rank_loads.astype(jnp.float32) * pair_fwd_s))
    return carry_like(state, counts)


def make_copy(state: CopyState, e, d, amount, ok, cand, home, link, pair_fwd_s: float) -> CopyState:
    """Put a copy of candidate e on rank d taking `amount` pairs off its home rank, where ok."""
    num_ranks, slots = state.guests.shape
    amount = jnp.where(ok, amount, 0)
    at_d = ok & (jnp.arange(num_ranks) == d)
    put = at_d[:, None] & (jnp.arange(slots)[None, :] == state.used[d])
    is_e = jnp.arange(state.spill.shape[0]) == e
    return state._replace(
        spill=state.spill - jnp.where(is_e, amount, 0),
        room=state.room - jnp.where(at_d, amount, 0),
        used=state.used + at_d.astype(jnp.int32),
        holds=state.holds | (at_d[:, None] & is_e[None, :]),
        guests=jnp.where(put, cand[e], state.guests),
        quotas=jnp.where(put, amount, state.quotas),
        clock=clock_after_copy(state.clock, home, d, link, amount.astype(jnp.float32) * pair_fwd_s, ok))


def finish_plan(planner: PlannerBase, counts, placement, state: CopyState, cand) -> Plan:
    """Locality swaps among the candidates into the slots left (they need expert shapes to be
    priced), then the plan."""
    guests, quotas = state.guests, state.quotas
    if planner.dims is not None:
        guests, quotas = locality_swaps(counts, placement, guests, quotas, cand, planner.topology, planner.dims)
    slot_expert, quota = guest_quotas_to_slots(placement, guests, quotas, counts.sum(0))
    return plan_from_quotas(counts, slot_expert, quota, planner.topology.gpus_per_node, True, jnp)
