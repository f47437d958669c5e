"""Topology-oblivious baseline in the spirit of DeepSeek's EPLB, re-planned every micro-batch.

The baseline keeps its one-replica-per-step loop (R x K steps): it is the comparison the parallel
planners are measured against, not a planner to scale. Replicas are handed out one at a time to the expert with the largest load per copy, each onto the
least-loaded rank (loads estimated from an even split) with a free guest slot that does not hold the
expert yet. Each expert's pairs are split evenly over its copies, and sources feed copies in (d, j)
order without regard to locality.

`EplbPlanner` runs on the device inside jit; `eplb_host` is the same algorithm in NumPy, to measure
what planning on the CPU costs (device-to-host copy, solve, host-to-device copy). Both are written
once against an array namespace and agree bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Int

from jtopoep.costmodel import copy_break_even_pairs
from jtopoep.ordering import first_argmax, first_argmin
from jtopoep.plan import Plan, home_rank_of_experts
from jtopoep.planners.arrays import carry_like, holds_home, one_hot, prefix_sum
from jtopoep.planners.base import PlannerBase
from jtopoep.planners.routing import SlotQuotas, plan_from_quotas


def repeat(body, times: int, carry, xp):
    """body(i, carry) applied `times` times: a Python loop on NumPy arrays, else a fori_loop."""
    if xp is np:
        for i in range(times):
            carry = body(i, carry)
        return carry
    return jax.lax.fori_loop(0, times, body, carry)


def even_quotas(slot_expert: Int[ArrayLike, "R S"], loads: Int[ArrayLike, " E"], xp=jnp) -> Int[ArrayLike, "R S"]:
    """[R, S] split each expert's load evenly over its copies; the first copies in (d, j) order take
    one pair more when the load does not divide."""
    num_ranks, num_slots = slot_expert.shape
    flat = slot_expert.reshape(-1)
    hot = one_hot(flat, loads.shape[0], xp)  # [R*S, E]
    copies = hot.sum(0)  # [E]
    index_in_expert = ((prefix_sum(hot, 0, xp) - hot) * hot).sum(1)
    safe = xp.maximum(flat, 0)
    n = xp.maximum(copies[safe], 1)
    quota = loads[safe] // n + (index_in_expert < loads[safe] % n).astype(xp.int32)
    return xp.where(flat >= 0, quota, 0).reshape(num_ranks, num_slots).astype(xp.int32)


def eplb_slots(counts: Int[ArrayLike, "R E"], placement: Int[ArrayLike, "R H"], guest_slots: int, min_pairs: float,
               xp) -> tuple[Int[ArrayLike, "R S"], Int[ArrayLike, "R S"]]:
    """Slots [R, S] and even-split quotas [R, S] of the EPLB policy, written once for numpy and
    jax.numpy (xp) so the host and device planners agree bit for bit. A replica is only made while
    each copy would still get at least one pair and at least min_pairs."""
    num_ranks, home = placement.shape
    num_experts = counts.shape[1]
    loads = counts.sum(0).astype(xp.int32)
    guests = xp.full((num_ranks, guest_slots), -1, xp.int32)
    state = (guests, xp.ones(num_experts, xp.int32), xp.zeros(num_ranks, xp.int32),
             holds_home(home_rank_of_experts(placement, xp), num_ranks, xp))
    slot_ids = xp.arange(guest_slots, dtype=xp.int32)
    rank_ids = xp.arange(num_ranks, dtype=xp.int32)

    def step(_, state):
        guests, copies, used, holds = state
        free = (used < guest_slots)[:, None] & ~holds  # [R, E]: rank could take a copy of e
        per_copy = loads.astype(xp.float32) / copies.astype(xp.float32)
        next_share = loads.astype(xp.float32) / (copies + 1).astype(xp.float32)
        wanted = free.any(0) & (next_share >= xp.float32(min_pairs)) & (loads > copies)
        e = first_argmax(xp.where(wanted, per_copy, xp.float32(-1)), xp=xp)
        slots = xp.concatenate([placement, guests], axis=1)
        share = loads // copies
        estimate = xp.where(slots >= 0, share[xp.maximum(slots, 0)], 0).sum(1)
        limit = xp.iinfo(xp.int32).max
        d = first_argmin(xp.where(free[:, e], estimate, limit), xp=xp)
        ok = wanted[e] & free[d, e]
        put = ok & (rank_ids[:, None] == d) & (slot_ids[None, :] == used[d])
        guests = xp.where(put, e, guests)
        copies = copies + (ok & (xp.arange(num_experts) == e)).astype(xp.int32)
        used = used + (ok & (rank_ids == d)).astype(xp.int32)
        holds = holds | (ok & (rank_ids[:, None] == d) & (xp.arange(num_experts)[None] == e))
        return guests, copies, used, holds

    state = carry_like(state, counts)
    state = repeat(step, num_ranks * guest_slots, state, xp)
    slot_expert = xp.concatenate([placement, state[0]], axis=1).astype(xp.int32)
    return slot_expert, even_quotas(slot_expert, loads, xp)


@dataclasses.dataclass(frozen=True)
class EplbPlanner(PlannerBase):
    tiered: ClassVar[bool] = False  # topology-oblivious: sources and slots in rank order

    @property
    def least_pairs(self) -> float:
        """Fewest pairs a replica must get: min_gain's share of an NVLink copy's break-even."""
        return 0.0 if self.min_gain == 0 else self.min_gain * copy_break_even_pairs(self.topology, self.dims)[0]

    def _quotas(self, counts, placement, held) -> SlotQuotas:
        del held  # copies are placed without regard to what ranks hold already
        return SlotQuotas(*eplb_slots(counts, placement, self.guest_slots, self.least_pairs, jnp))


def eplb_host(planner: EplbPlanner, counts: Int[ArrayLike, "R E"], placement: Int[ArrayLike, "R H"] | None = None
              ) -> Plan:
    """The eplb planner in NumPy on the host: copies counts off the device, plans, copies the plan back."""
    counts = np.asarray(jax.device_get(counts)).astype(np.int32)
    if placement is None:
        placement = np.arange(planner.num_experts, dtype=np.int32).reshape(planner.num_ranks, -1)
    placement = np.asarray(jax.device_get(placement)).astype(np.int32)
    slot_expert, quota = eplb_slots(counts, placement, planner.guest_slots, planner.least_pairs, np)
    plan = plan_from_quotas(counts, slot_expert, quota, planner.topology.gpus_per_node, False, np)
    return jax.device_put(plan)
