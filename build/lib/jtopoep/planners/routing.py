"""Locality-tiered token routing: which source sends how many pairs of each expert to each copy.

Each node keeps what it can of an expert's pairs on its own copies, and shares them out so as to
level the ranks' traffic across nodes (node_shares); the rest crosses nodes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.ordering import first_argmax
from jtopoep.plan import Plan
from jtopoep.planners.common import prefix_sum, scatter_add, scatter_set
from jtopoep.planners.loops import repeat


def _overlap(s_hi, supply, c_hi, capacity, xp):
    """Length of the overlap of the intervals [s_hi - supply, s_hi) and [c_hi - capacity, c_hi)."""
    return xp.maximum(xp.minimum(s_hi, c_hi) - xp.maximum(s_hi - supply, c_hi - capacity), 0)


def _nonnegative_div(a, b: int, xp):
    """a // b for a >= 0: one truncating division. jnp's floor division adds sign fix-ups that
    XLA then repeats in every element of the [m, m] and [R, m] kernels these indices feed."""
    return a // b if xp is np else jax.lax.div(a, jnp.asarray(b, a.dtype))


# Rounds of node_shares' relaxation. More rounds barely move the cluster projection; two, not one,
# keep the rounds a loop, which XLA:CPU compiles as one kernel (a loop of one round it inlines into
# separate, slower kernels).
BALANCE_ROUNDS = 2


def water_fill(height, room, total, xp=jnp):
    """Integer amounts along axis 1 of [B, G, X] arrays that share about `total` ([B, X]) so that
    what each member is left with, height - amount, is as level as the rooms allow:
    floor(clip(height - level, 0, room)), with the level at which the unfloored amounts sum to total
    (total <= the rooms' sum). The floors leave fewer than G short (top_up).

    The fill as a function of the level falls piecewise linearly, with breaks at each member's
    height and height - room. It is evaluated at all 2G breaks, in integers; the level lies between
    the highest break that still fills total and the lowest that does not, found with the fills
    there by four reductions that do not depend on each other, and is interpolated by elementwise
    float32 arithmetic: the same on every device, with no sort or search loop."""
    total = total[:, None, :]
    breaks = xp.concatenate([height, height - room], axis=1)  # [B, 2G, X]
    fill = xp.clip(height[:, None] - breaks[:, :, None], 0, room[:, None]).sum(2)  # [B, 2G, X]
    reached = fill >= total
    far = 2 ** 30
    lo = xp.where(reached, breaks, -far).max(1, keepdims=True)
    hi = xp.where(reached, far, breaks).min(1, keepdims=True)
    fill_lo = xp.where(reached, fill, far).min(1, keepdims=True)  # the fill falls as the level rises
    fill_hi = xp.where(reached, 0, fill).max(1, keepdims=True)
    # total = 0 leaves nothing unreached: hi stays far, and the level is lo, the highest height.
    f32 = xp.float32
    step = xp.where(hi < far, (hi - lo).astype(f32) / xp.maximum(fill_lo - fill_hi, 1).astype(f32), f32(0))
    level = lo.astype(f32) + (fill_lo - total).astype(f32) * step
    return xp.floor(xp.clip(height.astype(f32) - level, f32(0), room.astype(f32))).astype(xp.int32)


def top_up(amount, room, total, xp=jnp):
    """amount [B, G, X] plus one for each of the first members along axis 1 with room left, as many
    as it falls short of total [B, X]. Callers round amounts down from shares of total, which leaves
    fewer short than members with room left; topped up, a node's sources and copies agree on how many
    pairs it keeps, and none crosses nodes for want of rounding. The members with room up to each one
    are counted by cumsum, which XLA:CPU lowers to one reduce-window kernel costing G^2 per column:
    cheap for the few GPUs of a node, and cheaper than a product with a [G, G] triangle of ones."""
    short = total - amount.sum(1)
    has_room = amount < room
    order = xp.cumsum(has_room.astype(xp.int32), axis=1)  # members with room up to each
    return amount + (has_room & (order <= short[:, None])).astype(xp.int32)


def node_shares(counts, slot_expert, supply, room, real, compact_expert, home_rank, gpus_per_node: int,
                xp=jnp):
    """([R, X] pairs each copy takes from its own node, [R, X] pairs each source gives to its own
    node's copies, [R] pairs each rank receives across nodes for the experts without copies), for X
    experts with copies by compact id: the node keeps min(its supply, its copies' room) of each,
    and the first two choose who takes and who gives them.

    The exchange waits for the rank that receives the most pairs across nodes, and for the one
    that sends the most. A rank receives across nodes what its slots take beyond their own node's
    pairs, so the pairs a node keeps of an expert go to its copies whose ranks would otherwise
    receive the most (water_fill on each rank's cross-node receive), and likewise come from the
    sources that would otherwise send the most. Ranks hold slots of several experts, so this is a
    relaxation: start from shares in proportion to room and supply, then BALANCE_ROUNDS times
    water-fill every expert's node shares against the ranks' totals of the round before. The gives
    move halfway each round: a source gives to every expert with a copy on its node, so moving all
    the way overshoots (it oscillated on Mixtral's layers). Takes and gives are stacked along the
    first axis and filled in one call. Integers, with float32 in elementwise steps only, so the
    same on every device.

    supply [R, X]: counts of each compact expert; room [R, X]: each rank's quota of it (0 where it
    holds no copy); real [X]: the compact ids of experts with guest copies (where ids are guest
    slots, an expert's later guests repeat its first); home_rank [E]."""
    num_ranks, num_experts = counts.shape
    num_ids = room.shape[1]
    nodes = num_ranks // gpus_per_node
    supply = xp.where(real[None, :], supply, 0)
    room = xp.where(real[None, :], room, 0)
    # Rows 0..N-1 are the copies' side of each node, N..2N-1 the sources'.
    limit = xp.concatenate([room, supply]).reshape(2 * nodes, gpus_per_node, num_ids)
    kept = xp.minimum(limit[:nodes].sum(1), limit[nodes:].sum(1))  # [N, X]
    kept = xp.concatenate([kept, kept])  # [2N, X]
    # Cross-node receive and send of the experts without copies: all their pairs go home.
    if xp is np:
        shared = np.zeros(num_experts, bool)
        shared[compact_expert[real]] = True
    else:
        index = jnp.where(real, compact_expert, num_experts + jnp.arange(num_ids))
        shared = jnp.zeros(num_experts, bool).at[index].set(True, mode="drop", unique_indices=True)
    rank_node = xp.arange(num_ranks) // gpus_per_node
    node_counts = counts.reshape(nodes, gpus_per_node, num_experts).sum(1)  # [N, E]
    home = slot_expert[:, :num_experts // num_ranks]  # [R, H]
    arriving = counts.sum(0)[home] - node_counts[rank_node[:, None], home]
    fixed_receive = xp.where(shared[home], 0, arriving).sum(1)
    leaving = ~shared[None, :] & ((home_rank // gpus_per_node)[None, :] != rank_node[:, None])
    fixed_send = xp.where(leaving, counts, 0).sum(1)
    fixed = xp.concatenate([fixed_receive, fixed_send]).reshape(2 * nodes, gpus_per_node, 1)

    whole = xp.maximum(limit.sum(1, keepdims=True), 1).astype(xp.float32)
    share = xp.floor(kept[:, None].astype(xp.float32) * limit.astype(xp.float32) / whole).astype(xp.int32)
    shares = top_up(share, limit, kept, xp)  # [2N, G, X]: in proportion to room and to supply

    def relax(_, shares):
        # Each rank's receive (sources' rows: send) across nodes if this expert's share were 0.
        height = fixed + (limit - shares).sum(2, keepdims=True) + shares
        filled = water_fill(height, limit, kept, xp)
        # An odd sum rounds down with room left, so the top-up restores the total.
        halfway = xp.concatenate([filled[:nodes], (shares[nodes:] + filled[nodes:]) // 2])
        return top_up(halfway, limit, kept, xp)

    shares = repeat(relax, BALANCE_ROUNDS, shares, xp)  # one kernel on CPU, not some twenty a round
    return shares[:nodes].reshape(num_ranks, num_ids), shares[nodes:].reshape(num_ranks, num_ids), fixed_receive


# Rounds of level_receive's relaxation: two level the scale-out receive better than one where a
# hot expert's copies span several nodes; as a loop, XLA:CPU runs them as one kernel (see
# BALANCE_ROUNDS).
LEVEL_ROUNDS = 2
# Copies per expert that level_receive re-divides (the first ones in rank order; any further copies
# keep what they take): filling over every rank gave the same cluster projections at a higher
# planning cost.
LEVEL_MEMBERS = 8


def level_receive(cross, present, fixed, load, xp=jnp):
    """[R, X] pairs each rank's copy of each expert takes from other nodes, re-divided among the
    expert's copies so that the ranks' scale-out receive is as level as their load allows.

    After the node tier every copy's remaining quota is filled from other nodes, so a rank receives
    across nodes `fixed` (its experts without copies) plus what its copies take there, and the
    exchange waits for the rank that receives the most. An expert's copies can share its pairs
    from other nodes in any proportion: each round water-fills every expert's total over its first
    LEVEL_MEMBERS copies against the ranks' receive without it, as node_shares does within a node.
    A copy may take more only as far as its rank's load stays at or below the busiest rank's,
    which sets the GEMM term: each rank's slack below it is split evenly among its copies. Totals
    per expert are kept, so every pair still lands; a rank's load changes by what its copies give
    up or take on.

    cross [R, X]: pairs from other nodes per (rank, expert with copies); present [R, X]: the rank
    holds a copy; fixed [R]; load [R]: pairs of all of each rank's slots."""
    num_ranks, num_ids = cross.shape
    top = load.max()
    copies = xp.maximum(present.sum(1), 1)
    # The copies of x on ranks up to each, [R, X]; member m of x is its copy number m + 1, on the
    # rank that is the number of ranks with at most m copies up to them, [M, X] (R where none).
    order = xp.cumsum(present.astype(xp.int32), axis=0)
    rank_of = (order[None, :, :] <= xp.arange(LEVEL_MEMBERS)[:, None, None]).sum(1)
    is_member = rank_of < num_ranks
    rank_of = xp.minimum(rank_of, num_ranks - 1)
    ids = xp.arange(num_ids)[None, :]
    # Each copy's member number, to read its new share back: a gather, not a scatter (which
    # would keep XLA:CPU from compiling the rounds' loop as one kernel).
    levelled = present & (order <= LEVEL_MEMBERS)
    number = xp.minimum(order, LEVEL_MEMBERS) - 1

    def settle(cross, load, shares):
        """cross with every levelled copy's share set to its member's entry of shares [M, X], and
        load changed by what each rank's copies gave up or took on."""
        settled = xp.where(levelled, shares[xp.maximum(number, 0), ids], cross)
        return settled, load + (settled - cross).sum(1)

    def members(cross):  # [M, X] each member's pairs from other nodes
        return xp.where(is_member, cross[rank_of, ids], 0)

    def relax(_, carry):
        # Each round settles the shares the round before found, then fills anew. The shares travel
        # to the next round in the loop's state: read back by a gather in the round that fills
        # them, XLA fused the whole fill into every element of that gather.
        cross, load, shares = carry
        cross, load = settle(cross, load, shares)
        receive = fixed + cross.sum(1)
        mine = members(cross)
        # water_fill levels what the members are left with, height - amount: with each rank's
        # receive without this expert negated, that is levelling the receive with it. A missing
        # member repeats the first one's height with no room: no new break, no share.
        depth = mine - receive[rank_of]
        depth = xp.where(is_member, depth, depth[:1])
        room = xp.where(is_member, mine + ((top - load) // copies)[rank_of], 0)
        total = mine.sum(0)[None, :]
        return cross, load, top_up(water_fill(depth[None], room[None], total, xp), room[None], total, xp)[0]

    # The members' own shares settle to cross unchanged, so the first round starts from cross.
    cross, load, shares = repeat(relax, LEVEL_ROUNDS, (cross, load, members(cross)), xp)
    return settle(cross, load, shares)[0]


def plan_from_quotas(counts, slot_expert, quota, gpus_per_node: int, tiered: bool, xp=jnp, experts=None,
                     level: bool = False) -> Plan:
    """The plan for given slot contents and per-slot quotas: every slot takes exactly its quota
    (with level=True, see below).

    Greedy transport by interval overlap, per expert: lay its sources (rank order) and its copies
    (rank order) end to end on one line each, by prefix sums, and send along the overlap of their
    intervals. With tiered=True each node first keeps as many of an expert's pairs as its copies
    there can take (its own rank's pairs first), shared out among those copies and its sources by
    node_shares so that no rank is left to send or receive far more across nodes than the others;
    then the rest goes anywhere. tiered=False is the topology-oblivious split.

    Only experts with guest copies need this; every other expert sends all its pairs to its home
    slot. The transport runs on the m = 2 * R * K slots that can hold such copies (the guest slots,
    and the home slot of each guest's expert, listed once), laid out per source and slot, [R, m]:
    its cost grows with the guest slots, not with E or with the square of the ranks. Requires
    sum of quotas per expert == its load: every pair lands and nothing is invented.

    experts: optional [C] distinct expert ids among which every guest copy's expert is (a copy
    loop's candidates). Then the home slots listed are those C, m = R * K + C, and no pairwise
    search for the distinct guest experts is needed: with C = R and K = 2, a quarter fewer entries.
    The plan is the same either way.

    level (with tiered): after the node tier, the pairs each expert sends across nodes are re-divided
    among its copies by level_receive, which levels the ranks' scale-out receive; the slots' quotas
    then change, but no rank's load rises above the busiest rank's and every pair still lands."""
    if level and not tiered:
        raise ValueError("level=True levels what the locality tiers leave to cross nodes; it needs tiered=True")
    num_ranks, num_experts = counts.shape
    num_slots = slot_expert.shape[1]
    home = num_experts // num_ranks
    guest_slots = num_slots - home
    n = num_ranks * num_slots
    counts = counts.astype(xp.int32)
    flat_expert = slot_expert.reshape(-1)
    # Every pair of an expert without guests goes to its home slot.
    base = xp.where((flat_expert >= 0)[None, :], counts[:, xp.maximum(flat_expert, 0)], 0)  # [R(s), n]
    if guest_slots == 0:
        return Plan(slot_expert.astype(xp.int32), base.reshape(num_ranks, num_ranks, num_slots))
    slot_of = (xp.arange(num_ranks)[:, None] * num_slots + xp.arange(num_slots)[None, :]).astype(xp.int32)
    home_slot = scatter_set(num_experts, slot_expert[:, :home].reshape(-1), slot_of[:, :home].reshape(-1), xp)
    guest = slot_expert[:, home:].reshape(-1)  # [R*K]
    # Experts with guests get compact ids, and the transport works on [R, ids] arrays of those, not
    # [R, E]: with `experts`, an expert's index there; else the index of its first guest slot.
    if experts is None:
        compact_expert = guest  # [R*K] by compact id; -1 where no guest
        same = (guest[:, None] == guest[None, :]) & (guest >= 0)[:, None]
        compact_of_guest = first_argmax(same, axis=1, xp=xp).astype(xp.int32)
        listed_home = (guest >= 0) & (compact_of_guest == xp.arange(guest.shape[0]))
        has_guests = listed_home
    else:
        compact_expert = experts.astype(xp.int32)  # [C]
        hit = guest[:, None] == compact_expert[None, :]
        compact_of_guest = ((hit * xp.arange(1, compact_expert.shape[0] + 1, dtype=xp.int32)).sum(1) - 1)
        listed_home = xp.ones(compact_expert.shape, bool)
        has_guests = hit.any(0)
    num_ids = compact_expert.shape[0]
    listed = xp.concatenate([slot_of[:, home:].reshape(-1),
                             xp.where(listed_home, home_slot[xp.maximum(compact_expert, 0)], -1)])
    m = listed.shape[0]
    ids = xp.arange(m, dtype=xp.int32)
    valid = xp.concatenate([guest >= 0, listed_home])
    safe = xp.concatenate([xp.maximum(compact_of_guest, 0),
                           xp.arange(num_ids, dtype=xp.int32)]).astype(xp.int32)  # compact id per entry
    capacity = xp.where(valid, quota.reshape(-1)[xp.maximum(listed, 0)], 0).astype(xp.int32)  # [m]
    rank = _nonnegative_div(xp.maximum(listed, 0), num_slots, xp)
    node = _nonnegative_div(rank, gpus_per_node, xp)

    def copy_prefix(cap, first_rank, width: int):
        """[m] end of each copy's interval: the capacity of the copies of its expert on ranks
        first_rank .. its own (a rank holds at most one copy of an expert, so rank order is the
        copies' order; `width` ranks from first_rank are looked at). Looked up in a [rank, expert]
        table of capacities, [m, width] elements, where a masked sum over all pairs of entries took
        [m, m] (and XLA:CPU split that over threads, which cost more than the sum)."""
        table = scatter_add((num_ranks, num_ids), (rank, safe), xp.where(valid, cap, 0), xp)
        at = first_rank[:, None] + xp.arange(width, dtype=xp.int32)[None, :]  # [m, width]
        mine = table[xp.minimum(at, num_ranks - 1), safe[:, None]]
        return xp.where(at <= rank[:, None], mine, 0).sum(1)

    supply = xp.where((compact_expert >= 0)[None, :], counts[:, xp.maximum(compact_expert, 0)], 0)  # [R, ids]
    if tiered:
        # Within the node: how many of the node's pairs each copy takes and each source gives
        # (node_shares, balanced across experts), then who gives to whom. A copy takes its own
        # rank's pairs first; the rest pair up by interval overlap of prefix sums restarting at each
        # node, sources and copies each in rank order. Whatever is left goes through the anywhere tier.
        room = scatter_add((num_ranks, num_ids), (rank, safe), xp.where(valid, capacity, 0), xp)  # [R, ids]
        home_rank = _nonnegative_div(home_slot, num_slots, xp)
        # Only experts with guests are shared out: a listed expert without any goes home whole,
        # as it would unlisted, so listing one changes nothing.
        take, give, fixed_receive = node_shares(counts, slot_expert, supply, room, has_guests, compact_expert,
                                                home_rank, gpus_per_node, xp)
        share = xp.where(valid, take[rank, safe], 0)  # [m]
        own = xp.minimum(share, give[rank, safe])
        src = node[:, None] * gpus_per_node + xp.arange(gpus_per_node)[None, :]  # [m, G]
        own_at_src = scatter_add((num_ranks, num_ids), (rank, safe), own, xp)[src, safe[:, None]]
        rest = give[src, safe[:, None]] - own_at_src
        c_hi = copy_prefix(share - own, node * gpus_per_node, gpus_per_node)
        in_node = _overlap(prefix_sum(rest, 1, xp), rest, c_hi[:, None], (share - own)[:, None], xp)
        in_node = in_node + xp.where(src == rank[:, None], own[:, None], 0)
        supply = supply - scatter_add((num_ranks, num_ids), (src, xp.broadcast_to(safe[:, None], src.shape)),
                                      in_node, xp)
        capacity = capacity - in_node.sum(1)
        if level:
            shared = valid & has_guests[safe]  # copies of experts with guests
            cross = scatter_add((num_ranks, num_ids), (rank, safe), xp.where(shared, capacity, 0), xp)
            present = scatter_add((num_ranks, num_ids), (rank, safe), shared.astype(xp.int32), xp) > 0
            cross = level_receive(cross, present, fixed_receive, quota.sum(1).astype(xp.int32), xp)
            capacity = xp.where(shared, cross[rank, safe], capacity)
        # Each source's in-node pairs, [source, listed slot], by a scatter of the [m, G] array: read
        # back by a gather instead, XLA fused the whole in-node transport into every element of the
        # anywhere tier below.
        flow = scatter_add((num_ranks, m), (src, xp.broadcast_to(ids[:, None], src.shape)), in_node, xp)
    else:
        flow = xp.zeros((num_ranks, m), xp.int32)  # [source, listed slot]: no in-node tier
    supply = supply[:, safe]  # [R, m]
    c_hi = copy_prefix(capacity, xp.zeros_like(rank), num_ranks)
    anywhere = _overlap(prefix_sum(supply, 0, xp), supply, c_hi[None, :], capacity[None, :], xp)
    flow = xp.where(valid[None, :], flow + anywhere, 0)
    # Written into the listed slots' columns by a scatter, which makes XLA compute `flow` once; as a
    # gather it fused the whole transport into every element of the route Each
    # slot is listed at most once; unused entries point past the end, each somewhere else, and drop.
    if xp is np:
        route = base.copy()
        route[:, listed[listed >= 0]] = flow[:, listed >= 0]
    else:
        column = jnp.where(listed >= 0, listed, n + ids)
        route = base.at[:, column].set(flow, mode="drop", unique_indices=True)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
