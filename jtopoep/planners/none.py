"""The baseline: every pair goes to its expert's home slot, guest slots stay empty."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jtopoep.plan import Plan, home_plan
from jtopoep.planners.base import PlannerBase, home_quotas
from jtopoep.planners.routing import SlotQuotas


@dataclasses.dataclass(frozen=True)
class NonePlanner(PlannerBase):
    def __call__(self, counts, placement=None, held=None) -> Plan:
        slot_expert, _ = self.quotas(counts, placement, held)  # checks the arguments
        # A gather of the counts, not the route lines:
        return home_plan(jnp.asarray(counts, jnp.int32), slot_expert[:, :self.home_slots], self.guest_slots)

    def _quotas(self, counts, placement, held) -> SlotQuotas:
        del held  # copies are placed without regard to what ranks hold already
        return home_quotas(counts, placement, self.guest_slots)
