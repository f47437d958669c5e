"""The baseline: every pair goes to its expert's home slot, guest slots stay empty."""

from __future__ import annotations

import dataclasses

from jtopoep.plan import Plan, home_plan
from jtopoep.planners.base import PlannerBase


@dataclasses.dataclass(frozen=True)
class NonePlanner(PlannerBase):
    def _plan(self, counts, placement, held) -> Plan:
        del held  # copies are placed without regard to what ranks hold already
        return home_plan(counts, placement, self.guest_slots)
