"""The planner interface: counts [R, E] and a placement in, a Plan out; pure, jittable, deterministic.

A planner is a frozen dataclass, hashable, so it can be a static argument of jit. Its fields are its
knobs: `jtopoep.config` takes their names, defaults and comments from here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from jtopoep.costmodel import ExpertDims, crossing_break_even_pairs
from jtopoep.plan import Plan
from jtopoep.planners.problem import CopyProblem, Pricing
from jtopoep.planners.rounds import Copies, onto_demand, place
from jtopoep.planners.routing import SlotQuotas, plan_from_quotas
from jtopoep.topology import Topology


@dataclasses.dataclass(frozen=True)
class PlannerBase:
    """Settings every planner shares. Subclasses implement `_quotas(counts, placement, held)`."""

    # Sources feed the slots on their own node first (routing.route_lines); False: in rank order.
    tiered: ClassVar[bool] = True
    # The knobs a run file sets: {planner field: MoEConfig key}, whose default is the field's
    # (jtopoep.layer.make_planner reads them, a test checks the defaults).
    config_keys: ClassVar[dict[str, str]] = {"min_gain": "min_gain", "price_transfers": "price_transfers"}

    topology: Topology
    num_experts: int
    guest_slots: int
    # A copy must save at least min_gain x the time of shipping its weights out and its gradients
    # back (costmodel.copy_break_even_pairs), ignoring any overlap; 0 turns the check off. Needs dims.
    min_gain: float = 0.0
    dims: ExpertDims | None = None
    # Refuse copies that expose more weight-transfer time than the GEMM time they save (the cost
    # model's rule, problem.paying_pieces). False balances load whatever the transfers cost.
    price_transfers: bool = True

    def __post_init__(self):
        ranks = self.topology.num_ranks
        if self.num_experts < 1 or self.num_experts % ranks:
            raise ValueError(f"num_experts = {self.num_experts} must be a positive multiple of the "
                             f"{ranks} ranks of the topology")
        if self.guest_slots < 0:
            raise ValueError(f"guest_slots = {self.guest_slots} must be >= 0")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain = {self.min_gain} must be >= 0")
        if self.min_gain > 0 and self.dims is None:
            raise ValueError("min_gain > 0 needs dims (ExpertDims) to price a copy's weight transfer")

    @property
    def num_ranks(self) -> int:
        return self.topology.num_ranks

    @property
    def home_slots(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node

    @property
    def pricing(self) -> Pricing | None:
        return Pricing.make(self.topology, self.dims, self.min_gain, self.price_transfers)

    def __call__(self, counts: Int[ArrayLike, "R E"], placement: Int[ArrayLike, "R H"] | None = None,
                 held: Int[ArrayLike, "R K"] | None = None) -> Plan:
        """The plan for counts [R, E] with home experts placement [R, H] (default contiguous), with
        its whole [R, R, S] route: for analysis. The layer calls `quotas` and derives only its own
        part of the route.

        held: [R, K] the guest experts each rank holds from the previous micro-batch of the same
        optimizer step (-1 empty; moe.keep_copies): a copy of one of those ships only its gradients,
        which the pricing counts."""
        slot_expert, quota = self.quotas(counts, placement, held)
        return plan_from_quotas(jnp.asarray(counts, jnp.int32), slot_expert, quota, self.gpus_per_node, self.tiered)

    def quotas(self, counts: Int[ArrayLike, "R E"], placement: Int[ArrayLike, "R H"] | None = None,
               held: Int[ArrayLike, "R K"] | None = None) -> SlotQuotas:
        """What the planner decides for counts [R, E]: the expert in each slot and the pairs each
        slot takes (arguments as for calling the planner)."""
        num_ranks, num_experts = counts.shape
        if (num_ranks, num_experts) != (self.num_ranks, self.num_experts):
            raise ValueError(f"counts has shape {counts.shape}; this planner expects "
                             f"({self.num_ranks}, {self.num_experts})")
        if held is not None and tuple(held.shape) != (self.num_ranks, self.guest_slots):
            raise ValueError(f"held has shape {tuple(held.shape)}; it must be [R, K] = "
                             f"({self.num_ranks}, {self.guest_slots}), the guest experts of each rank")
        if placement is None:
            placement = jnp.arange(num_experts, dtype=jnp.int32).reshape(num_ranks, self.home_slots)
        counts, placement = jnp.asarray(counts, jnp.int32), jnp.asarray(placement, jnp.int32)
        if self.guest_slots == 0:  # no slot to copy into: every planner reduces to the home plan
            return home_quotas(counts, placement, 0)
        return self._quotas(counts, placement, None if held is None else jnp.asarray(held, jnp.int32))

    def _quotas(self, counts, placement, held) -> SlotQuotas:
        raise NotImplementedError


def home_quotas(counts: Int[Array, "R E"], placement: Int[Array, "R H"], guest_slots: int) -> SlotQuotas:
    """Every pair goes to its expert's home slot; guest slots stay empty."""
    loads = counts.sum(0, dtype=jnp.int32)
    pad = ((0, 0), (0, guest_slots))
    return SlotQuotas(jnp.pad(placement.astype(jnp.int32), pad, constant_values=-1),
                      jnp.pad(loads[placement], pad))


@dataclasses.dataclass(frozen=True)
class CopyingPlanner(PlannerBase):
    """A planner that solves the shared copy problem: its subclass chooses where copies go
    (`_place`), and every home slot keeps what its copies do not take; tokens follow the
    locality-tiered routing."""

    def _quotas(self, counts, placement, held) -> SlotQuotas:
        problem = CopyProblem.build(counts, placement, self.gpus_per_node, self.guest_slots)
        copies = self._place(problem, placement, Copies.start(problem, self.guest_slots, self.gpus_per_node), held)
        return SlotQuotas(jnp.concatenate([placement, copies.guests], axis=1),
                          jnp.concatenate([copies.kept[placement], copies.quotas], axis=1))

    def _place(self, problem: CopyProblem, placement, copies: Copies, held) -> Copies:
        raise NotImplementedError

    def _where_pairs_come_from(self, problem: CopyProblem, placement, copies: Copies, held) -> Copies:
        """The first round: copies of each spilling expert on the nodes whose own sources send it the
        pairs it spills (rounds.onto_demand), so those pairs cross no link, in at most half of each
        rank's guest slots (the rest stay for balancing: with one slot, none)."""
        width = self.guest_slots // 2
        if self.topology.num_nodes == 1 or width == 0:
            return copies
        # A piece must keep enough pairs on its node that their crossings outweigh its weights and
        # gradients crossing, and take half a rank's load: smaller ones left room on ranks whose
        # slots they had taken, which the balancing rounds could then not fill.
        least = problem.target // 2
        if self.dims is not None:
            least = jnp.maximum(least, int(crossing_break_even_pairs(self.dims)))
        proposals = onto_demand(copies, problem, placement, self.gpus_per_node, least, width)
        return place(copies, *proposals, problem, placement, self.pricing, held, self.gpus_per_node, overshed=True)


__all__ = ["CopyingPlanner", "PlannerBase", "home_quotas"]
