"""TopoEP: deterministic, topology-aware placement of guest copies, then locality-tiered routing.

1. loads L_e, home rank loads W_r, target T* = ceil(sum L / R);
2. spill: each rank above T* sheds its excess, attributed to its home experts hottest first;
3. one copy per step, for the expert with the most spill left (at most R * K steps, ending early
   once no spill is left):
   inter-node choice: for each node, its best free rank (most room below T*, a free guest slot, not
   holding the expert) could absorb min(spill, room) pairs; the node that saves the most inter-node
   bytes (its own pairs of the expert that stop crossing the scale-out link, minus the weights and
   gradients that must cross it) wins, and among nodes within 10% of that saving the one that absorbs
   the most, so each copy fills a rank or ends the spill (few slots, balance at the bound);
   intra-node refinement: within that node, the least-loaded free rank (most room);
   a copy must save more GEMM time on the hot rank than the weight-transfer time it exposes under the
   cost model (common.TransferClock: transfers hide behind home-slot GEMMs until those run out) and
   pass the min-gain test for its link class, else the expert's remaining spill stays home;
4. load-neutral locality swaps fill free slots where they save inter-node bytes (common.locality_swaps);
5. each home slot keeps what its copies do not take; sources feed copies on their own rank, then
   their own node, then anywhere (common.route_to_copies).

Every quantity is an integer except the bytes-saved score, a float32 computed identically everywhere;
ties go to the lowest index, so every device computes the same plan bit for bit.

Deviation from the design's two separate phases (all copies to nodes, then vmapped per-node GPU
choice): node and GPU are chosen in the same step, because the GPU's remaining room decides how much
the node can absorb, which is what the next copy's node choice depends on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jtopoep.costmodel import EXCHANGES_PER_LAYER
from jtopoep.plan import Plan
from jtopoep.planners.common import (PlannerBase, carry_like, ceil_div, guest_quotas_to_slots, home_rank_of_experts,
                                     TransferClock, clock_after_copy, copy_exposure, locality_swaps,
                                     transfer_costs,
                                     one_hot, plan_from_quotas, spill_per_expert)


@dataclasses.dataclass(frozen=True)
class TopoEPPlanner(PlannerBase):
    def _plan(self, counts, placement) -> Plan:
        num_ranks, num_experts = counts.shape
        nodes, gpus, slots = self.topology.num_nodes, self.gpus_per_node, self.guest_slots
        loads = counts.sum(0)
        target = ceil_div(loads.sum(), num_ranks)
        rank_loads = loads[placement].sum(1)
        home_node = home_rank_of_experts(placement) // gpus  # [E]
        node_pairs = counts.reshape(nodes, gpus, num_experts).sum(1).astype(jnp.float32)  # [N, E]
        thr_intra, thr_inter = self.gain_thresholds()
        if self.dims is None:
            pair_bytes, copy_bytes = 1.0, 0.0
        else:
            pair_bytes = EXCHANGES_PER_LAYER * self.dims.pair_bytes
            copy_bytes = 2.0 * self.dims.expert_bytes
        link_s, pair_fwd_s, pair_s = transfer_costs(self.topology, self.dims)
        node_ids = jnp.arange(nodes, dtype=jnp.int32)
        rank_ids = jnp.arange(num_ranks, dtype=jnp.int32)
        slot_ids = jnp.arange(slots, dtype=jnp.int32)
        spill0 = spill_per_expert(loads, placement, target)
        # Each step makes at most one copy and there are R * K slots, so at most R * K experts ever
        # get one, all among the R * K with the most spill (then load): the loop runs on those
        # candidates only, which keeps its cost independent of E.
        num_cand = min(num_experts, num_ranks * slots)
        by_load = jnp.argsort(-loads, stable=True)
        cand = by_load[jnp.argsort(-spill0[by_load], stable=True)][:num_cand]  # [C] expert ids
        expert_ids = jnp.arange(num_cand, dtype=jnp.int32)
        cand_home = home_rank_of_experts(placement)[cand]  # [C]

        remote = node_ids[:, None] != home_node[cand][None, :]  # [N, C]
        # Pairs of e from node n that cross the scale-out link to reach e's home node.
        crossing0 = jnp.where(remote, node_pairs[:, cand], 0.0)
        never = jnp.int32(-1)

        def step(state):
            i, spill, room, used, holds, guests, quotas, crossing, clock = state
            e = jnp.argmax(spill)
            need = spill[e]
            free = (used < slots) & ~holds[:, e] & (room > 0)  # [R]
            room_free = jnp.where(free, room, never).reshape(nodes, gpus)
            absorb = jnp.minimum(need, room_free.max(1))  # [N]
            # The copy must save more GEMM time on the hot rank than the transfer time it exposes.
            dest = node_ids * gpus + jnp.argmax(room_free, axis=1)  # [N] each node's best rank
            home = cand_home[e]
            moved = absorb.astype(jnp.float32)
            exposure = copy_exposure(clock, home, dest, link_s[home, dest], moved * pair_fwd_s)
            usable = ((absorb > 0) & (absorb >= jnp.where(remote[:, e], thr_inter, thr_intra))
                      & (moved * pair_s >= exposure))
            saved = (jnp.minimum(absorb.astype(jnp.float32), crossing[:, e]) * pair_bytes
                     - jnp.where(remote[:, e], copy_bytes, 0.0))
            # Nodes within 10% of the best saving count as equally good for traffic; among them the
            # one that absorbs the most, so that each copy fills a rank (few slots, good balance).
            key = jnp.where(usable, saved, -jnp.inf)
            best = key.max()
            near = usable & (key >= best - 0.1 * jnp.abs(best))
            node = jnp.argmax(jnp.where(near, absorb, never))
            ok = usable.any()
            d = dest[node]
            amount = jnp.where(ok, absorb[node], 0)
            clock = clock_after_copy(clock, home, d, link_s[home, d], amount.astype(jnp.float32) * pair_fwd_s, ok)
            at_d = ok & (rank_ids == d)
            put = at_d[:, None] & (slot_ids[None, :] == used[d])
            is_e = expert_ids == e
            # A spilling expert that cannot be placed anywhere keeps its spill at home.
            spill = jnp.where(is_e, jnp.where(ok, need - amount, 0), spill)
            room = room - jnp.where(at_d, amount, 0)
            used = used + at_d.astype(jnp.int32)
            holds = holds | (at_d[:, None] & is_e[None, :])
            guests = jnp.where(put, cand[e], guests)
            quotas = jnp.where(put, amount, quotas)
            served = (node_ids[:, None] == node) & is_e[None, :]
            crossing = jnp.maximum(crossing - jnp.where(served, amount.astype(jnp.float32), 0.0), 0.0)
            return (jnp.where(need > 0, i + 1, num_ranks * slots), spill, room, used, holds, guests, quotas,
                    crossing, clock)

        state = (jnp.int32(0),
                 spill0[cand],
                 jnp.maximum(target - rank_loads, 0),
                 jnp.zeros(num_ranks, jnp.int32),
                 (one_hot(placement, num_experts).sum(1) > 0)[:, cand],
                 jnp.full((num_ranks, slots), -1, jnp.int32),
                 jnp.zeros((num_ranks, slots), jnp.int32),
                 crossing0,
                 TransferClock(jnp.zeros(num_ranks), jnp.zeros(num_ranks),
                               rank_loads.astype(jnp.float32) * pair_fwd_s))
        state = carry_like(state, counts)
        # At most one copy per step and R * K slots; the loop also ends once no move is left. The
        # exit test reads only values every device holds identically, so all stop at the same step.
        state = jax.lax.while_loop(lambda st: st[0] < num_ranks * slots, step, state)
        guests, quotas = state[5], state[6]
        if self.dims is not None:  # swaps are priced in bytes and seconds: they need the expert shape
            guests, quotas = locality_swaps(counts, placement, guests, quotas, self.topology, self.dims)
        slot_expert, quota = guest_quotas_to_slots(placement, guests, quotas, loads)
        return plan_from_quotas(counts, slot_expert, quota, gpus, True, jnp)

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node
