"""TopoEP: topology-aware copies in a few parallel rounds, then locality-tiered routing.

1. the copy problem (problem.CopyProblem): target T* = ceil(sum L / R), each rank above it sheds
   its excess, attributed to its home experts hottest first, each one's pairs from its own node
   last (CopyProblem.shed_last: at home they cross no link); ranks below it have room;
1b. where the pairs come from (CopyingPlanner._where_pairs_come_from, with two guest slots or
   more): each spilling expert's copies on the nodes whose own sources send it the pairs it
   spills, up to those pairs, in half of each rank's slots: those pairs then cross no link;
2. within nodes: each node's spill against its own ranks' room, largest first (rounds.match): those
   copies travel over NVLink only;
3. across nodes, then within each node, in ACROSS_ROUNDS rounds: the spill left against the nodes'
   room, largest first, so a hot expert's copies fill few nodes (its weights cross to few of them);
   then each node's share against its ranks' room (one piece a rank where the spill's pieces would
   outnumber the free slots: rounds.slots_are_scarce); beside it, ranks whose guest slots are full
   take more of their guests' pairs (rounds.top_up), which opens room on the homes for the next
   round;
4. every round prices its copies at once by the cost model's rule (problem.paying_pieces); what no
   copy takes stays at home;
5. each home slot keeps what its copies do not take; sources feed copies on their own node first,
   then anywhere (routing.plan_from_quotas).

Integers throughout but the pricing's float32 seconds, elementwise; sorts with total orders (ties to
the lower index): every device computes the same plan bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jtopoep.planners.base import CopyingPlanner
from jtopoep.planners.problem import CopyProblem
from jtopoep.planners.rounds import Copies, across_nodes, place, within_nodes

# Rounds across nodes. Each places what the rounds before left for want of a free slot or of room
# (the room over-shedding opens on a home rank is filled by the next round); chains of that run a
# few rounds deep when slots are scarce (one guest slot and one home expert per rank).
ACROSS_ROUNDS = 4


@dataclasses.dataclass(frozen=True)
class TopoEPPlanner(CopyingPlanner):
    def _place(self, problem: CopyProblem, placement, copies: Copies, held) -> Copies:
        gpus, pricing = self.gpus_per_node, self.pricing
        copies = self._where_pairs_come_from(problem, placement, copies, held)
        copies = place(copies, *within_nodes(copies, problem, placement, gpus), problem, placement, pricing, held,
                       gpus, overshed=True)

        return across_nodes(copies, problem, placement, pricing, held, gpus, ACROSS_ROUNDS)
