"""TopoEP: deterministic, topology-aware placement of guest copies, then locality-tiered routing.

1. loads L_e, home rank loads W_r, target T* = ceil(sum L / R);
2. spill: each rank above T* sheds its excess, attributed to its home experts hottest first;
3. one copy per step, for the expert with the most spill left (at most R * K steps, ending early
   once no spill is left):
   inter-node choice: for each node, its best free rank (most room below T*, a free guest slot, not
   holding the expert) could absorb min(spill, room) pairs; among the nodes that absorb at least
   half of what the best one can (a sliver of a copy spends a slot and a transfer), the node that
   saves the most inter-node bytes (its own pairs of the expert that stop crossing the scale-out
   link, minus the weights and gradients that must cross it) wins, and among nodes within 10% of
   that saving the one that absorbs the most, so each copy fills a rank or ends the spill;
   intra-node refinement: within that node, the least-loaded free rank (most room), or a rank that
   holds the expert from the step's previous micro-batch (`held`) and absorbs as much;
   a copy must save more GEMM time on the hot rank, plus exchange_credit x the exchange time it saves
   where its home's scale-out receive binds (pricing.exchange_saving), than the weight-transfer time
   it exposes under the cost model (pricing.TransferClock: transfers hide behind home-slot GEMMs until
   those run out) and pass the min-gain test for its link class, else the expert's remaining spill
   stays home;
   a copy into its rank's last free slot that would leave room there takes all of it when free
   slots on ranks with room are fewer than the experts still spilling, which opens room (and free
   slots) on the expert's home rank for the next ones (copies.copy_overshedding);
4. load-neutral locality swaps fill free slots: first with the rank that receives the most across
   nodes, which sets the exchange term, then where they save inter-node bytes (swaps.locality_swaps);
5. each home slot keeps what its copies do not take; sources feed copies on their own rank, then
   their own node, then anywhere (routing.plan_from_quotas).

Every quantity is an integer except the pricing's seconds and the bytes-saved score, float32 computed
identically everywhere;
ties go to the lowest index, so every device computes the same plan bit for bit.

Deviation from the design's two separate phases (all copies to nodes, then vmapped per-node GPU
choice): node and GPU are chosen in the same step, because the GPU's remaining room decides how much
the node can absorb, which is what the next copy's node choice depends on.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jtopoep.costmodel import EXCHANGES_PER_LAYER
from jtopoep.ordering import first_argmax
from jtopoep.plan import Plan, home_rank_of_experts
from jtopoep.planners.common import (PlannerBase, carry_like, ceil_div, holds_held, num_copy_candidates,
                                     spill_candidates, spill_per_expert, uncovered_node_pairs)
from jtopoep.planners.copies import copy_overshedding, finish_plan, start_copies
from jtopoep.planners.loops import step_until_done
from jtopoep.planners.pricing import (copy_exposure, exchange_saving, home_node_share, node_link_class,
                                      scale_out_shift)


@dataclasses.dataclass(frozen=True)
class TopoEPPlanner(PlannerBase):
    def _plan(self, counts, placement, held) -> Plan:
        num_ranks, num_experts = counts.shape
        nodes, gpus, slots = self.topology.num_nodes, self.gpus_per_node, self.guest_slots
        loads = counts.sum(0)
        target = ceil_div(loads.sum(), num_ranks)
        thr_intra, thr_inter = self.gain_thresholds()
        if self.dims is None:
            pair_bytes, copy_bytes = 1.0, 0.0
        else:
            pair_bytes = EXCHANGES_PER_LAYER * self.dims.pair_bytes
            copy_bytes = 2.0 * self.dims.expert_bytes
        link_s, pair_fwd_s, pair_s, pair_xchg_s = self.transfer_costs()
        node_ids = jnp.arange(nodes, dtype=jnp.int32)
        rank_node = jnp.arange(num_ranks, dtype=jnp.int32) // gpus
        spill0 = spill_per_expert(loads, placement, target)
        num_cand = num_copy_candidates(num_experts, num_ranks, slots)
        cand = spill_candidates(spill0, loads, num_cand)  # [C] expert ids
        expert_ids = jnp.arange(num_cand, dtype=jnp.int32)
        cand_home = home_rank_of_experts(placement)[cand]  # [C]

        remote = node_ids[:, None] != (cand_home // gpus)[None, :]  # [N, C]
        crossing0 = uncovered_node_pairs(counts, loads, spill0, cand, cand_home, gpus)  # [N, C]
        never = jnp.int32(-1)
        rank_remote = node_link_class(self.topology)  # [R, R] across nodes
        held_cand = holds_held(held, cand)  # [R, C], or None
        kept = loads[cand] - spill0[cand]  # [C] pairs each candidate's home slot keeps after its spill

        def step(carry):
            state, crossing = carry
            e = first_argmax(state.spill)
            need = state.spill[e]
            home = cand_home[e]
            # A rank qualifies if it has a free slot and room, does not hold e yet, and the copy saves
            # more GEMM time on the hot rank than the transfer time it exposes (and passes min-gain).
            take = jnp.minimum(need, state.room).astype(jnp.float32)  # [R]
            exposure = copy_exposure(state.clock, home, None, link_s[home], take * pair_fwd_s)
            # The exchange time the copy saves where its home's scale-out receive binds (none to
            # compute without an exchange credit).
            col = crossing[:, e]  # [N]
            home_node = home // gpus
            credit, share = 0.0, jnp.zeros_like(col)
            if pair_xchg_s:
                share = home_node_share(col, home_node)  # [N]
                drop, rise = scale_out_shift(take, col[rank_node], share[rank_node], rank_node == home_node)
                credit = exchange_saving(state.clock, home, None, drop * pair_xchg_s, rise * pair_xchg_s)
            qualifies = ((state.used < slots) & ~state.holds[:, e] & (state.room > 0)
                         & (take * pair_s + credit >= exposure))
            if thr_inter or thr_intra:
                qualifies &= take >= jnp.where(rank_remote[home], thr_inter, thr_intra)
            room_free = jnp.where(qualifies, state.room, never).reshape(nodes, gpus)
            absorb = jnp.minimum(need, room_free.max(1))  # [N]
            best = first_argmax(room_free, axis=1)  # [N] each node's rank with the most room
            if held_cand is not None:
                # A rank that holds e already and absorbs as much as the node's best keeps its copy
                # and ships no weights: it takes the copy instead.
                keeps = (held_cand[:, e].reshape(nodes, gpus) & (room_free > 0)
                         & (jnp.minimum(need, room_free) >= absorb[:, None]))
                best = jnp.where(keeps.any(1), first_argmax(keeps, axis=1), best)
            dest = node_ids * gpus + best  # [N]
            moved = absorb.astype(jnp.float32)
            usable = absorb > 0
            saved = (jnp.minimum(moved, crossing[:, e]) * pair_bytes - jnp.where(remote[:, e], copy_bytes, 0.0))
            # Only nodes that absorb at least half what the best one can compete on bytes: the home
            # rank ships every copy of e, and a sliver of a copy spends a slot and a transfer on it.
            # Nodes within 10% of the best saving among those count as equally good for traffic;
            # among them the one that absorbs the most wins, so that each copy fills a rank (few
            # slots, good balance). Each test compares every node with every other ([N, N], one
            # kernel each; a maximum, then a comparison with it, takes two): x - 0.1 |x| rises with
            # x, so clearing every big node's own threshold is clearing the best one's. (Choosing by
            # the copy's worth in seconds instead was less robust to a slower scale-out link in
            # benchmarks.cluster.)
            big = usable & jnp.all(2 * absorb[:, None] >= absorb[None, :], axis=1)
            threshold = saved - 0.1 * jnp.abs(saved)
            near = big & jnp.all(~big[None, :] | (saved[:, None] >= threshold[None, :]), axis=1)
            first = (absorb[:, None] > absorb[None, :]) | ((absorb[:, None] == absorb[None, :])
                                                          & (node_ids[:, None] <= node_ids[None, :]))
            wins = near & jnp.all(~near[None, :] | first, axis=1)
            winner = (wins * (node_ids + 1)).sum()  # 1 + the winning node; 0 when no node can take e
            node, ok = jnp.maximum(winner - 1, 0), winner > 0
            d = dest[node]
            state, amount = copy_overshedding(state, e, d, absorb[node], ok, cand, cand_home, kept, link_s[home, d],
                                              pair_fwd_s, (col[node], share[node], node == home_node), pair_xchg_s)
            # A spilling expert that cannot be placed anywhere keeps its spill at home.
            state = state._replace(spill=jnp.where((expert_ids == e) & ~ok, 0, state.spill),
                                   step=jnp.where(need > 0, state.step + 1, num_ranks * slots))
            served = (node_ids[:, None] == node) & (expert_ids == e)[None, :] & ok
            crossing = jnp.maximum(crossing - jnp.where(served, amount.astype(jnp.float32), 0.0), 0.0)
            return state, crossing

        state = start_copies(counts, placement, cand, spill0, target, slots, pair_fwd_s, pair_xchg_s, self.topology)
        # At most one copy per step and R * K slots; the loop also ends once no spill is left. The
        # exit test reads only values every device holds identically, so all stop at the same step.
        state, _ = step_until_done(step, (state, carry_like(crossing0, counts)), lambda c: c[0].step,
                                   num_ranks * slots)
        return finish_plan(self, counts, placement, state, cand)

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node
