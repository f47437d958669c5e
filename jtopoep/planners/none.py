"""The baseline: every pair goes to its expert's home slot, guest slots stay empty."""

from __future__ import annotations

import dataclasses

from jtopoep.planners.base import PlannerBase, home_quotas
from jtopoep.planners.routing import SlotQuotas


@dataclasses.dataclass(frozen=True)
class NonePlanner(PlannerBase):
    def _quotas(self, counts, placement, held) -> SlotQuotas:
        del held  # copies are placed without regard to what ranks hold already
        return home_quotas(counts, placement, self.guest_slots)
