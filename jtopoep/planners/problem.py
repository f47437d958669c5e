"""The copy problem every copying planner solves, built once: loads, the balance target, each
expert's spill above it, each rank's room below it, and the one rule for whether a copy pays.

Integers throughout, except the pricing's seconds: float32, elementwise or by maxima, so the same
on every device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims, copy_break_even_pairs
from jtopoep.ordering import inverse_permutation
from jtopoep.planners.arrays import (ceil_div, earlier_in_segment, order_by, pairwise_or_sorted,
                                     scatter_set, segmented_prefix_sum)
from jtopoep.topology import Topology


def spill_per_expert(loads: Int[ArrayLike, " E"], placement: Int[ArrayLike, "R H"], target: Int[ArrayLike, "..."],
                     xp=jnp, home_slot: Int[ArrayLike, " E"] | None = None,
                     shed_last: Int[ArrayLike, " E"] | None = None) -> Int[ArrayLike, " E"]:
    """[E] pairs above target on each rank, attributed to its home experts hottest first (ties to
    the lower slot). shed_last: [E] pairs of each expert to shed only once every expert of its rank
    has shed the rest (CopyProblem.shed_last), in the same order.
    home_slot: [E] each expert's flat home slot (CopyProblem.home_slot), which gathers the result
    where the placement would scatter it (a fused gather, not a kernel of its own)."""
    home_loads = loads[placement]  # [R, H]
    slot = xp.arange(placement.shape[1])
    mine, other = home_loads[:, :, None], home_loads[:, None, :]
    # Pairs of the rank's experts that shed before each one: a pairwise count over the H home
    # slots, cheaper than a per-row sort for the few slots a rank has.
    ahead = (other > mine) | ((other == mine) & (slot[None, None, :] < slot[None, :, None]))  # [R, H, H]
    excess = xp.maximum(home_loads.sum(1) - target, 0)[:, None]
    last = xp.zeros_like(home_loads) if shed_last is None else xp.minimum(shed_last[placement], home_loads)
    first = home_loads - last
    spill = xp.minimum(first, xp.maximum(excess - (ahead * first[:, None, :]).sum(2), 0))
    if shed_last is not None:
        excess = xp.maximum(excess - first.sum(1, keepdims=True), 0)
        spill = spill + xp.minimum(last, xp.maximum(excess - (ahead * last[:, None, :]).sum(2), 0))
    if home_slot is not None:
        return spill.reshape(-1)[home_slot].astype(loads.dtype)
    return scatter_set(loads.shape[0], placement.reshape(-1), spill.reshape(-1).astype(loads.dtype), xp)


class CopyProblem(NamedTuple):
    """What a copying planner starts from; rounds.Copies derives each rank's room and each expert's
    spill from it and the copies made (ranks above the target shed their excess, hottest home
    experts first, so spilling experts live on ranks without room)."""
    loads: Int[Array, " E"]  # pairs routed to each expert
    rank_loads: Int[Array, " R"]  # pairs of each rank's home experts
    target: Int[Array, ""]  # ceil(sum of loads / R): no plan's busiest rank can take fewer
    home_slot: Int[Array, " E"]  # each expert's home slot, flat: rank x H + slot
    remote_share: Float[Array, " R"]  # share of each rank's home pairs that come from other nodes
    node_loads: Int[Array, "N E"]  # pairs each node's sources send each expert
    # Pairs of each expert its home sheds only once the rest of its rank's have shed: its own node's,
    # which cross no link at home. Only for an expert that fits on one rank: a hotter one has copies
    # on its own node, which keep them there, and holding them at home would push its rank's other
    # experts off in slivers that take the guest slots.
    shed_last: Int[Array, " E"]

    @classmethod
    def build(cls, counts: Int[Array, "R E"], placement: Int[Array, "R H"], gpus_per_node: int,
              guest_slots: int) -> "CopyProblem":
        num_ranks = counts.shape[0]
        # Each home's pairs less those its own node's sources send come from [N, E] node totals,
        # not a [R, R] source-by-home table (R^2 H gathered elements at 1024 ranks).
        node_counts = counts.reshape(num_ranks // gpus_per_node, gpus_per_node, -1).sum(1)
        loads = node_counts.sum(0)
        target = ceil_div(loads.sum(), num_ranks)
        rank_loads = loads[placement].sum(1)
        home_slot = scatter_set(loads.shape[0], placement.reshape(-1), jnp.arange(placement.size, dtype=jnp.int32))
        own_node = (jnp.arange(num_ranks) // gpus_per_node)[:, None]
        remote = rank_loads - node_counts[own_node, placement].sum(1)
        share = remote.astype(jnp.float32) / jnp.maximum(rank_loads, 1).astype(jnp.float32)
        home_node = home_slot // (placement.shape[1] * gpus_per_node)
        last = jnp.where(loads <= target, node_counts[home_node, jnp.arange(loads.shape[0])], 0)
        # Shedding other nodes' pairs first spreads a rank's spill over more of its experts: only
        # where the spilling experts would not outnumber the guest slots on ranks with room by more
        # than a quarter (top-ups let a guest take the rest of its expert's spill, so a few more
        # than the slots still place; many more leave spill no slot takes).
        spilling = (spill_per_expert(loads, placement, target, home_slot=home_slot, shed_last=last) > 0).sum()
        fits = spilling * 4 <= guest_slots * (rank_loads < target).sum() * 5
        return cls(loads, rank_loads, target, home_slot, share, node_counts, jnp.where(fits, last, 0))

    @property
    def home_rank(self) -> Int[Array, " E"]:
        """Each expert's home rank: its home slot over the H slots a rank has."""
        return self.home_slot // (self.loads.shape[0] // self.rank_loads.shape[0])


class Pricing(NamedTuple):
    """The cost model's rule for whether a copy pays, as static numbers. A copy ships its expert's
    weights out of the home rank and its gradients back; the cost model hides a home's transfers
    behind its home-slot GEMMs (the forward for weights, the backward, twice as long, for
    gradients) and charges the most exposed rank. A copy pays when the GEMM and scale-out exchange
    seconds it takes off the home rank are at least what it adds to those maxima, and it takes at
    least the min-gain share of the pairs that would pay for its whole transfer on its link class."""
    pair_s: float  # forward+backward GEMM seconds of one pair
    pair_fwd_s: float  # forward GEMM seconds of one pair
    pair_exchange_s: float  # seconds of one pair's token exchanges (forward and backward) across nodes
    copy_s: tuple[float, float]  # seconds to ship one expert over (NVLink, the scale-out link)
    least_pairs: tuple[float, float]  # min-gain pairs over (NVLink, the scale-out link)

    @classmethod
    def make(cls, topology: Topology, dims: ExpertDims | None, min_gain: float, priced: bool) -> "Pricing | None":
        """None where nothing is priced (no dims, or pricing off and no min-gain)."""
        if dims is None or (not priced and not min_gain):
            return None
        rate = topology.flops * topology.mfu
        copy_s = (dims.expert_bytes / topology.intra_bw, dims.expert_bytes / topology.inter_bw) if priced else (0.0, 0.0)
        least = tuple(min_gain * p for p in copy_break_even_pairs(topology, dims))
        exchange_s = EXCHANGES_PER_LAYER * dims.pair_bytes / topology.inter_bw if priced else 0.0
        return cls(dims.pair_flops / rate if priced else 0.0, dims.pair_flops / 3.0 / rate, exchange_s, copy_s, least)


class Shipped(NamedTuple):
    """Per home rank: pairs shed so far and transfers it makes, [R, 4] by (weights over NVLink,
    weights across nodes, gradients over NVLink, gradients across nodes); a held copy ships
    gradients only. Under the fan-out fetch (plan.guest_fetch) an expert crosses to each node
    holding copies of it once (`reached`), the node's relay the rest; a home's crossings past its
    node's share of links are handed to peers over NVLink (_over_links)."""
    shed: Int[Array, " R"]
    copies: Int[Array, "R 4"]
    reached: Bool[Array, "E N"]

    @classmethod
    def none(cls, num_ranks: int, num_experts: int, num_nodes: int) -> "Shipped":
        return cls(jnp.zeros(num_ranks, jnp.int32), jnp.zeros((num_ranks, 4), jnp.int32),
                   jnp.zeros((num_experts, num_nodes), bool))


def _node_others(copies: Int[Array, "R 4"], home, gpus_per_node: int) -> Int[Array, "P 2"]:
    """[P, 2] crossings (weights, gradients) the other homes of each `home`'s node have made."""
    across = copies[:, 1::2]
    node = across.reshape(-1, gpus_per_node, 2).sum(1)
    return node[home // gpus_per_node] - across[home]


def _over_links(copies, others, gpus_per_node: int):
    """copies [P, 4] at a home as the fetch sends them (plan.guest_fetch): a node's crossings spread
    over its G links, a home sends up to its node's share, ceil(node's crossings / G), across and
    hands the rest to peers over NVLink. The other homes' crossings counted are only those made in
    earlier rounds, so the share is never overstated."""
    columns = []
    for nvlink, across, other in ((0, 1, 0), (2, 3, 1)):
        share = ceil_div(copies[:, across] + others[:, other], gpus_per_node)
        handed = jnp.maximum(copies[:, across] - share, 0)
        columns += [copies[:, nvlink] + handed, copies[:, across] - handed]
    return jnp.stack(columns, 1)


def _exposed(copies, shed, rank_loads, pricing: Pricing):
    """(forward, backward) seconds of weight transfer a home rank cannot hide behind its GEMMs."""
    seconds = copies.astype(jnp.float32) * jnp.asarray(pricing.copy_s * 2, jnp.float32)
    hide = (rank_loads - shed).astype(jnp.float32) * pricing.pair_fwd_s
    weights = jnp.maximum(seconds[..., 0], seconds[..., 1])
    grads = jnp.maximum(seconds[..., 2], seconds[..., 3])
    return jnp.maximum(weights - hide, 0.0), jnp.maximum(grads - 2.0 * hide, 0.0)


def _home_transfers(expert, dest, amount, new, held, problem: CopyProblem, shipped: Shipped, gpus_per_node: int,
                    rank=None, earlier=None):
    """[P, 4] the transfers each copy adds at its home rank (Shipped.copies' columns): over NVLink to
    its own node; across nodes only for the first copy of its expert on a node not yet reached, the
    relay serving the others: its gradients, and its weights if it is the first there that does not
    hold them already. First in `rank` order, or where `earlier` [P, P] is given, in its order
    (earlier[p, q]: q comes first; it must order each home's copies); by default in index order."""
    num = expert.shape[0]
    home = problem.home_rank[jnp.maximum(expert, 0)]
    node = dest // gpus_per_node
    across = (home // gpus_per_node) != node
    ships = (amount > 0) & new
    key = jnp.maximum(expert, 0) * shipped.reached.shape[1] + node
    crossing = ships & across & ~shipped.reached.reshape(-1)[key]

    def first_of_key(candidate):
        if earlier is not None:
            return candidate & ~(earlier & candidate[None, :] & (key[None, :] == key[:, None])).any(1)
        ranks = jnp.arange(num, dtype=jnp.int32) if rank is None else rank
        first = jnp.full(shipped.reached.size, num, jnp.int32).at[key].min(jnp.where(candidate, ranks, num))
        return candidate & (first[key] == ranks)

    local = ships & ~across
    transfers = [local & ~held, first_of_key(crossing & ~held), local, first_of_key(crossing)]
    return jnp.stack(transfers, 1).astype(jnp.int32)


def paying_pieces(expert: Int[Array, " P"], dest: Int[Array, " P"], amount: Int[Array, " P"],
                  new: Bool[Array, " P"], held: Bool[Array, " P"], problem: CopyProblem, shipped: Shipped,
                  pricing: Pricing | None, gpus_per_node: int
                  ) -> tuple[Bool[Array, " P"], Int[Array, "P 4"]]:
    """Which of P proposed copies (expert onto dest rank, taking amount pairs off its home; new:
    it takes a slot, else it adds to a copy the rank has; held: the rank holds the expert from the
    step's previous micro-batch, so only gradients ship) to make, all decided at once; and the
    transfers each made one adds at its home (`ship` takes them).

    Each home rank's proposals are taken largest first while each pays: its GEMM seconds saved at
    least the rise of the largest exposed transfer (forward and backward) once it and the larger ones
    are made. Larger proposals pay first, so a home's accepted ones are a prefix of its list."""
    num = expert.shape[0]
    if pricing is None:
        made = amount > 0
        return made, pairwise_or_sorted(
            num, lambda: _home_transfers(expert, dest, amount, new & made, held, problem, shipped, gpus_per_node,
                                         earlier=earlier_in_segment(jnp.zeros(num, jnp.int32))),
            lambda: _home_transfers(expert, dest, amount, new & made, held, problem, shipped, gpus_per_node))
    return pairwise_or_sorted(num, lambda: _decide(expert, dest, amount, new, held, problem, shipped, pricing,
                                                   gpus_per_node, True),
                              lambda: _decide(expert, dest, amount, new, held, problem, shipped, pricing,
                                              gpus_per_node, False))


def _decide(expert, dest, amount, new, held, problem: CopyProblem, shipped: Shipped, pricing: Pricing,
            gpus_per_node: int, pairwise: bool):
    """paying_pieces with pricing: each home's proposals in its order as an [P, P] mask of which come
    first (pairwise), or sorted into it. The `_s` arrays are in the order the proposals are judged
    in: as given (pairwise) or sorted."""
    num = expert.shape[0]
    home = problem.home_rank[jnp.maximum(expert, 0)]
    across = (home // gpus_per_node) != (dest // gpus_per_node)
    num_ranks = problem.rank_loads.shape[0]
    segment = jnp.where(amount > 0, home, num_ranks)
    if pairwise:
        # Few proposals: each stays in its place, and each home's order is the mask of which of its
        # proposals come first (largest first), every use of it one fused comparison.
        earlier = earlier_in_segment(segment, jnp.maximum(amount, 0))
        kinds = _home_transfers(expert, dest, amount, new, held, problem, shipped, gpus_per_node, earlier=earlier)
        values = jnp.concatenate([jnp.maximum(amount, 0)[:, None], kinds], 1)
        running = values + jnp.where(earlier[:, :, None], values[None, :, :], 0).sum(1)
        home_s, amount_s, kinds_s, across_s = home, amount, kinds, across

        def after_a_refusal(pays):
            return (earlier & ~pays[None, :]).any(1)

        def in_place(x):
            return x
    else:
        # Many: sorted by home, largest first; each (expert, node)'s largest copy is the one that
        # crosses, and the rank of each copy in that order:
        order = order_by(segment, num_ranks + 1, jnp.maximum(amount, 0))
        kinds = _home_transfers(expert, dest, amount, new, held, problem, shipped, gpus_per_node,
                                inverse_permutation(order))
        home_s, amount_s, kinds_s, across_s, segment_s = (x[order] for x in (home, amount, kinds, across, segment))
        # Pairs shed and transfers made so far at each home, one segmented pass over both.
        running = segmented_prefix_sum(jnp.concatenate([jnp.maximum(amount_s, 0)[:, None], kinds_s], 1), segment_s,
                                       num_ranks + 1)
        sorted_index = jnp.arange(num, dtype=jnp.int32)

        def after_a_refusal(pays):
            refused = jnp.where(pays, num, sorted_index)
            first_refused = jnp.full(num_ranks + 1, num, jnp.int32).at[segment_s].min(refused)
            return sorted_index >= first_refused[segment_s]

        def in_place(x):
            return jnp.zeros_like(x).at[order].set(x, unique_indices=True)
    shed = running[:, 0] + shipped.shed[home_s]
    copies = running[:, 1:] + shipped.copies[home_s]
    loads = problem.rank_loads[home_s]
    others = _node_others(shipped.copies, home_s, gpus_per_node)
    after = _exposed(_over_links(copies, others, gpus_per_node), shed, loads, pricing)
    before = _exposed(_over_links(copies - kinds_s, others, gpus_per_node), shed - amount_s, loads, pricing)
    # A copy saves the GEMM time of its pairs on the home rank, and the home's scale-out receive of
    # them (its remote share: the copy is fed by its own node's pairs first), which sets the
    # exchange term where hot experts' homes receive the most.
    gain = amount_s.astype(jnp.float32) * (pricing.pair_s + problem.remote_share[home_s] * pricing.pair_exchange_s)
    least = jnp.where(across_s, pricing.least_pairs[1], pricing.least_pairs[0])

    def accepted(floors):
        rise = sum(jnp.maximum(a, m) - jnp.maximum(b, m) for a, b, m in zip(after, before, floors))
        pays = (amount_s > 0) & (gain >= rise) & (amount_s >= least)
        # A home's proposals after one that does not pay are not made either.
        return pays & ~after_a_refusal(pays)

    # The cost model charges the most exposed rank. First each home's copies are judged against the
    # maxima the copies already made leave; then again against the maxima those accepted ones reach
    # (a copy that stays below the round's largest exposure costs nothing), which only adds copies.
    every_home = jnp.arange(num_ranks)
    made_so_far = _over_links(shipped.copies, _node_others(shipped.copies, every_home, gpus_per_node), gpus_per_node)
    floors = tuple(x.max() for x in _exposed(made_so_far, shipped.shed, problem.rank_loads, pricing))
    first = accepted(floors)
    floors = tuple(jnp.maximum(m, jnp.where(first, a, 0.0).max()) for m, a in zip(floors, after))
    made = accepted(floors)
    # A home's accepted copies are the largest of its list, so each (expert, node)'s first one in
    # that order, the one counted as crossing, is made whenever any of them is.
    decided = in_place(jnp.concatenate([made[:, None], kinds_s], 1) * made[:, None])
    return decided[:, 0] > 0, decided[:, 1:]


def ship(shipped: Shipped, expert: Int[Array, " P"], dest: Int[Array, " P"], amount: Int[Array, " P"],
         new: Bool[Array, " P"], kinds: Int[Array, "P 4"], problem: CopyProblem, gpus_per_node: int) -> Shipped:
    """Shipped after the copies (expert onto dest taking amount; zero amounts are not made), whose
    transfers at their homes paying_pieces gave."""
    home = problem.home_rank[jnp.maximum(expert, 0)]
    num_ranks = shipped.shed.shape[0]
    made = (amount > 0) & new
    key = jnp.where(made, jnp.maximum(expert, 0) * shipped.reached.shape[1] + dest // gpus_per_node,
                    shipped.reached.size)
    reached = shipped.reached.reshape(-1).at[key].set(True, mode="drop").reshape(shipped.reached.shape)
    return Shipped(shipped.shed + jnp.zeros(num_ranks, jnp.int32).at[home].add(jnp.maximum(amount, 0)),
                   shipped.copies + jnp.zeros((num_ranks, 4), jnp.int32).at[home].add(kinds), reached)


__all__ = ["CopyProblem", "Pricing", "Shipped", "paying_pieces", "ship", "spill_per_expert"]
