"""TAOT: overload and spare capacity as an entropic optimal-transport problem over link costs.

1. supply a_r = max(W_r - mean W, 0) on overloaded ranks, demand b_r = max(mean W - W_r, 0) on light
   ranks (equal totals); cost M = topology.link_cost();
2. log-domain Sinkhorn (fixed epsilon and iteration count) gives a rank-to-rank flow hint F[h, l];
3. integer replica matching, one guest copy per step (at most R * K steps, ending when no move is
   left), over the min(E, R) experts with the most spill: for every (spilling expert e with home
   rank h, light rank l with a free slot not holding e) pair, the move is m = min(spill left of e,
   room left on l) and its score m * (1 + 1e-3 / (1 + M[h, l])) + min(m, F left on (h, l))
   + a * min(m, X left on (node of l, e)) - b * P * M[h, l], X being e's pairs from each node that no
   copy there takes yet (common.uncovered_node_pairs) and P the copy's weight and gradient bytes in
   pairs' worth of exchange bytes (its gradient bytes only where l holds e from the step's previous
   micro-batch, `held`): large moves first (each fills a rank or ends a spill, so few
   slots reach the balance bound), raised for the pairs the transport plan supports and for the
   pairs l's node feeds itself (they stop crossing), lowered by what shipping the copy costs over
   its link, the cheaper link on ties; the best move is made and charged against F[h, l] and X.
   a = locality_weight and b = weight_cost trade balance for weighted communication cost. Copies
   that fail the min-gain test for their link class, or expose more weight-transfer time than the
   GEMM time they save plus exchange_credit x the exchange time (the same pricing.TransferClock rule
   as topoep), are never matched. A move into its rank's last free slot may take more than the
   expert's spill, as in topoep (copies.copy_overshedding), when free slots are scarcer than
   spilling experts;
4. home slots keep what their copies do not take; token routing is the locality-tiered routing
   shared with topoep (planners.routing.plan_from_quotas).

Spill and room are integers against T* = ceil(sum L / R), so balance reaches the same bound as topoep;
only the float hint and score differ, computed in the same order on every device.
"""

from __future__ import annotations

import dataclasses

import jax
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
from jtopoep.planners.sinkhorn import sinkhorn


@dataclasses.dataclass(frozen=True)
class TaotPlanner(PlannerBase):
    # Defaults from the planner benchmark's sweep (benchmarks/results/planners.md): epsilon 1.0 gave
    # the best balance and converges within 10 iterations (more give the same plans); much smaller
    # values do not converge in any affordable number.
    epsilon: float = 1.0  # Sinkhorn regularisation in link-cost units (1 = one NVLink byte)
    iterations: int = 10  # Sinkhorn iterations (static)
    # The score's locality terms, from the same benchmark's sweep: these give taot the lowest
    # weighted communication cost of the planners while keeping its balance near the bound.
    locality_weight: float = 2.0  # weight of the pairs a copy keeps off the scale-out link
    weight_cost: float = 0.2  # weight of a copy's weight-transfer bytes times its link cost

    def __post_init__(self):
        super().__post_init__()
        if not self.epsilon > 0:
            raise ValueError(f"epsilon = {self.epsilon} must be > 0")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations = {self.iterations!r} must be a positive int")
        for knob in ("locality_weight", "weight_cost"):
            if not getattr(self, knob) >= 0:
                raise ValueError(f"{knob} = {getattr(self, knob)} must be >= 0")

    def flow_hint(self, counts, placement):
        """Sinkhorn output for the rank-level overload problem of these counts."""
        rank_loads = counts.sum(0)[placement].sum(1).astype(jnp.float32)
        mean = rank_loads.mean()
        supply = jnp.maximum(rank_loads - mean, 0.0)
        demand = jnp.maximum(mean - rank_loads, 0.0)
        return sinkhorn(supply, demand, jnp.asarray(self.topology.link_cost()), self.epsilon, self.iterations)

    def _plan(self, counts, placement, held) -> Plan:
        num_ranks, num_experts = counts.shape
        slots = self.guest_slots
        loads = counts.sum(0)
        target = ceil_div(loads.sum(), num_ranks)
        spill0 = spill_per_expert(loads, placement, target)
        # The experts with the most spill are the only candidates (num_copy_candidates), which
        # keeps the loop's cost independent of E.
        num_cand = num_copy_candidates(num_experts, num_ranks, slots)
        cand = spill_candidates(spill0, loads, num_cand)
        home = home_rank_of_experts(placement)[cand]  # [C]
        cost = jnp.asarray(self.topology.link_cost())
        thr_intra, thr_inter = self.gain_thresholds()
        threshold = jnp.where(node_link_class(self.topology)[home], thr_inter, thr_intra)  # [C, R]
        link_bonus = 1e-3 / (1.0 + cost[home])  # [C, R]
        link_s, pair_fwd_s, pair_s, pair_xchg_s = self.transfer_costs()
        link = link_s[home]  # [C, R] seconds to ship each candidate to each rank
        rank_ids = jnp.arange(num_ranks, dtype=jnp.int32)
        gpus = self.topology.gpus_per_node
        rank_node = rank_ids // gpus
        crossing0 = uncovered_node_pairs(counts, loads, spill0, cand, home, gpus)  # [N, C]
        same_node = rank_node[None, :] == (home // gpus)[:, None]  # [C, R]

        bonus = 1.0 + link_bonus  # [C, R]
        # What shipping each candidate to each rank costs, in the score's unit (pairs): the copy's
        # weights out and gradients back, in pairs' worth of exchange bytes, times the link cost.
        if self.dims is None:
            ship = jnp.zeros_like(cost[home])
        else:
            copy_pairs = 2.0 * self.dims.expert_bytes / (EXCHANGES_PER_LAYER * self.dims.pair_bytes)
            ship = self.weight_cost * copy_pairs * cost[home]  # [C, R]
            if held is not None:
                # A copy the rank holds from the step's previous micro-batch ships only its gradients.
                ship = jnp.where(holds_held(held, cand).T, 0.5 * ship, ship)
        cand_ids = jnp.arange(num_cand)
        kept = loads[cand] - spill0[cand]  # [C] pairs each candidate's home slot keeps after its spill

        def step(carry):
            # hint and crossing are carried per (candidate, rank): hint[h, l] of the candidate's home
            # h, and the crossing pairs of the candidate from the rank's node, so no step gathers.
            state, hint, crossing = carry
            amount = jnp.minimum(state.spill[:, None], state.room[None, :])  # [C, R]
            moved = amount.astype(jnp.float32)
            # A copy must save more GEMM time on the hot rank than the transfer time it exposes.
            exposure = copy_exposure(state.clock, home[:, None], None, link, moved * pair_fwd_s)
            # The exchange time a copy saves where its home's scale-out receive binds (none to
            # compute without an exchange credit).
            credit, share = 0.0, jnp.zeros_like(crossing)
            if pair_xchg_s:
                share = home_node_share(crossing.reshape(num_cand, -1, gpus)[:, :, 0], home // gpus)  # [C, N]
                share = jnp.repeat(share, gpus, axis=1)  # [C, R]
                drop, rise = scale_out_shift(moved, crossing, share, same_node)
                credit = exchange_saving(state.clock, home[:, None], None, drop * pair_xchg_s, rise * pair_xchg_s)
            feasible = ((amount > 0) & (state.used < slots)[None, :] & ~state.holds.T
                        & (moved * pair_s + credit >= exposure))
            if thr_inter or thr_intra:
                feasible &= moved >= threshold
            # The pairs moved, doubled for the share of them the transport plan routes from h to l:
            # slots go to large moves (each one fills a rank's room or ends an expert's spill), and
            # among similar moves to the destinations Sinkhorn found cheap; raised again for the
            # share the destination's node feeds itself (pairs that stop crossing); lowered by the
            # cost of shipping the copy there.
            score = (moved * bonus + jnp.minimum(moved, jnp.maximum(hint, 0.0))
                     + self.locality_weight * jnp.minimum(moved, crossing) - ship)
            # A move must be worth more than shipping its copy costs; scores only fall as the loop
            # runs, so once no move is worth it the loop ends.
            feasible &= score > 0
            # The masked score is computed once, behind an optimization barrier, and searched by
            # first_argmax's two plain reductions (the maximum, then its first index): without the
            # barrier XLA would fuse the whole score into both reductions.
            masked = jax.lax.optimization_barrier(jnp.where(feasible, score, -jnp.inf))
            flat = first_argmax(masked).astype(jnp.int32)
            e, d = flat // num_ranks, flat % num_ranks
            ok = feasible[e, d]
            state, taken = copy_overshedding(state, e, d, amount[e, d], ok, cand, home, kept, link[e, d], pair_fwd_s,
                                             (crossing[e, d], share[e, d], same_node[e, d]), pair_xchg_s)
            state = state._replace(step=jnp.where(ok, state.step + 1, num_ranks * slots))
            charged = jnp.where(ok, taken.astype(jnp.float32), 0.0)
            hint = hint - jnp.where((home[:, None] == home[e]) & (rank_ids[None, :] == d), charged, 0.0)
            served = (cand_ids[:, None] == e) & (rank_node[None, :] == rank_node[d])
            crossing = jnp.maximum(crossing - jnp.where(served, charged, 0.0), 0.0)
            return state, hint, crossing

        state = start_copies(counts, placement, cand, spill0, target, slots, pair_fwd_s, pair_xchg_s, self.topology)
        # One copy per step, until no feasible move is left (a test every device evaluates alike).
        hint = self.flow_hint(counts, placement).plan[home]  # [C, R]
        state, _, _ = step_until_done(step, (state, carry_like(hint, counts), carry_like(crossing0[rank_node].T, counts)),
                                      lambda c: c[0].step, num_ranks * slots)
        return finish_plan(self, counts, placement, state, cand)
