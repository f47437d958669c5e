"""jtopoep: topology-aware load balancing for expert-parallel MoE training in JAX."""

from jtopoep.config import MoEConfig, RunConfig, load_config
from jtopoep.costmodel import ExpertDims, layer_time
from jtopoep.dispatch import moe_dispatch
from jtopoep.guests import ExpertWeights, GuestCopies
from jtopoep.layer import MoELayer
from jtopoep.metrics import summarize
from jtopoep.plan import Plan, check_plan, home_plan
from jtopoep.planners import get_planner
from jtopoep.planners.routing import SlotQuotas
from jtopoep.rank_route import rank_route
from jtopoep.topology import Topology, make_mesh
from jtopoep.transport import exchange

__version__ = "0.1.0"

__all__ = ["ExpertDims", "ExpertWeights", "GuestCopies", "MoEConfig", "MoELayer", "Plan", "RunConfig", "SlotQuotas",
           "Topology", "check_plan", "exchange", "get_planner", "home_plan", "layer_time", "load_config", "make_mesh",
           "moe_dispatch", "rank_route", "summarize"]
