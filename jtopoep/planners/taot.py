"""TAOT: the spill between nodes as entropic optimal transport over link costs, rounded to copies.

1. the copy problem, the round that copies spilling experts onto the nodes their pairs come from
   (CopyingPlanner._where_pairs_come_from) and the within-node round, as topoep's: the link-cost
   plan below prices where the spill goes, not where each expert's pairs come from;
2. Sinkhorn (fixed epsilon and iteration count; on the scalings, the link costs being known when
   tracing, jtopoep.planners.sinkhorn) over the nodes: supply is each node's spill left, demand
   its ranks' open room, cost the link cost between the nodes (topology.link_cost); the plan
   F[n, m] says how much of node n's spill node m should take;
3. rounding: each node's spilling experts (largest first) are laid against its row of floor(F)
   (largest first), so every flow a node takes (its G largest) is cut into pieces of whole experts
   (rounds.match_pairs), and each node's pieces against its ranks' room, one piece a rank
   (rounds.pair_off); then topoep's rounds across nodes place what the rounding left
   (rounds.across_nodes);
4. every round prices its copies at once (problem.paying_pieces), and tokens follow the
   locality-tiered routing (routing.plan_from_quotas).

Against topoep's concentrating rule (a hot expert fills the nodes with most room first), the
entropic plan spreads each node's spill over the nodes in proportion to their room and the link
cost. Float32 only in Sinkhorn and its floor, computed in the same order on every device.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.planners.base import CopyingPlanner
from jtopoep.planners.problem import CopyProblem
from jtopoep.planners.rounds import Copies, across_nodes, match_pairs, onto_ranks_of_nodes, place, within_nodes
from jtopoep.planners.topoep import ACROSS_ROUNDS
from jtopoep.planners.sinkhorn import sinkhorn


@dataclasses.dataclass(frozen=True)
class TaotPlanner(CopyingPlanner):
    config_keys: ClassVar[dict[str, str]] = {**CopyingPlanner.config_keys, "epsilon": "sinkhorn_epsilon",
                                             "iterations": "sinkhorn_iters"}

    # Sinkhorn regularisation in link-cost units (1 = one NVLink byte); with the two link classes'
    # costs some eight apart it keeps spill on its own node where there is room, and spreads the
    # rest evenly by room.
    epsilon: float = 1.0
    iterations: int = 10  # Sinkhorn iterations (static)

    def __post_init__(self):
        super().__post_init__()
        if not self.epsilon > 0:
            raise ValueError(f"epsilon = {self.epsilon} must be > 0")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations = {self.iterations!r} must be a positive int")

    def _place(self, problem: CopyProblem, placement, copies: Copies, held) -> Copies:
        gpus, slots, pricing = self.gpus_per_node, self.guest_slots, self.pricing
        nodes = self.topology.num_nodes
        copies = self._where_pairs_come_from(problem, placement, copies, held)
        copies = place(copies, *within_nodes(copies, problem, placement, gpus), problem, placement, pricing, held,
                       gpus, overshed=True)
        if nodes > 1:
            spill, room = copies.spill(problem, placement), copies.open_room(problem, placement)
            home_node = problem.home_rank // gpus
            node_spill = jnp.zeros(nodes, jnp.int32).at[home_node].add(spill)
            node_room = room.reshape(nodes, gpus).sum(1)
            cost = np.asarray(self.topology.link_cost()[::gpus, ::gpus])  # known when tracing
            flow = sinkhorn(node_spill.astype(jnp.float32), node_room.astype(jnp.float32), cost, self.epsilon,
                            self.iterations).plan
            flow = jnp.floor(flow).astype(jnp.int32)  # [N, N], row n: node n's spill to each node
            # The entropic plan spreads every node's spill over all nodes with room; flows below an
            # average rank's room there would each spend a slot on a sliver. They are left to the
            # rounds across nodes, which place what the rounding leaves.
            flow = jnp.where(flow * gpus >= node_room[None, :], flow, 0)
            if nodes > gpus:
                # A flow kept is at least an average rank's room where it lands, so a node takes about G
                # flows at most: the pieces of its G largest (ties to the lower node), not of all N.
                _, sources = jax.lax.top_k(flow.T.astype(jnp.float32), gpus)  # [to, G]
            else:
                sources = jnp.broadcast_to(jnp.arange(nodes, dtype=jnp.int32), (nodes, nodes))
            # Each source node's experts against its row of flows, laid end to end (rounds.match), for
            # the flows each node takes: pieces [to, from, G * K].
            to = jnp.broadcast_to(jnp.arange(nodes, dtype=jnp.int32)[:, None], sources.shape)
            item, amount = match_pairs(spill, placement.reshape(nodes, -1), flow, gpus * slots, sources.reshape(-1),
                                       to.reshape(-1))
            node_pieces = jnp.arange(item.size, dtype=jnp.int32).reshape(nodes, -1)
            # One piece a rank: laid end to end, the flows' whole-expert pieces would be cut into slivers at
            # the ranks' edges, which take the slots the rounds across nodes need.
            proposals = onto_ranks_of_nodes(item.reshape(-1), amount.reshape(-1), node_pieces, room, gpus, slots,
                                            paired=True)
            copies = place(copies, *proposals, problem, placement, pricing, held, gpus, overshed=True)
        return across_nodes(copies, problem, placement, pricing, held, gpus, ACROSS_ROUNDS)
