"""Planners: counts[R, E] and a placement in, a Plan out; pure, jittable and deterministic.

`get_planner(name, topology=..., num_experts=..., guest_slots=..., **knobs)` returns a frozen,
hashable planner object callable as `planner(counts, placement=None) -> Plan`.
"""

from __future__ import annotations

from jtopoep.planners.base import PlannerBase
from jtopoep.planners.eplb import EplbPlanner, eplb_host
from jtopoep.planners.none import NonePlanner
from jtopoep.planners.taot import TaotPlanner
from jtopoep.planners.topoep import TopoEPPlanner

PLANNERS: dict[str, type[PlannerBase]] = {
    "none": NonePlanner,
    "eplb": EplbPlanner,
    "topoep": TopoEPPlanner,
    "taot": TaotPlanner,
}


def get_planner(name: str, *, topology, num_experts: int, guest_slots: int, **knobs) -> PlannerBase:
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; known planners: {sorted(PLANNERS)}")
    return PLANNERS[name](topology=topology, num_experts=num_experts, guest_slots=guest_slots, **knobs)


__all__ = ["PLANNERS", "PlannerBase", "EplbPlanner", "NonePlanner", "TaotPlanner", "TopoEPPlanner",
           "eplb_host", "get_planner"]
