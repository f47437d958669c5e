"""Load-neutral locality swaps: pairs of copies that turn crossing pairs into local ones."""

from __future__ import annotations

import jax.numpy as jnp

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims
from jtopoep.ordering import descending_key, first_argmax, key_range, stable_order
from jtopoep.plan import home_rank_of_experts
from jtopoep.planners.common import carry_like, guest_quotas_to_slots, holds_home, scatter_add, set_entry
from jtopoep.planners.loops import step_until_done
from jtopoep.planners.pricing import node_link_class, transfer_costs
from jtopoep.topology import Topology

# The swap search runs on the candidates of this many ranks; see locality_swaps.
SWAP_CANDIDATES = 16


def scale_out_receive(counts, placement, guests, quotas, gpus_per_node: int):
    """[R] estimated pairs each rank receives from other nodes under locality-tiered routing of the
    copies made so far (guests, quotas [R, K]): each node keeps what it can of an expert's pairs on
    its own slots of it, min(its pairs, those slots' quotas), and the rest of those quotas comes from
    other nodes, shared among the node's slots in proportion to their quotas (node_shares levels
    them instead, so this is an estimate). Rounded down per slot and summed in integers."""
    num_ranks, num_experts = counts.shape
    nodes = num_ranks // gpus_per_node
    slot_expert, quota = guest_quotas_to_slots(placement, guests, quotas, counts.sum(0))
    expert = jnp.maximum(slot_expert, 0)
    quota = jnp.where(slot_expert >= 0, quota, 0)
    rank_node = jnp.broadcast_to((jnp.arange(num_ranks) // gpus_per_node)[:, None], slot_expert.shape)
    node_supply = counts.reshape(nodes, gpus_per_node, num_experts).sum(1)  # [N, E]
    node_room = scatter_add((nodes, num_experts), (rank_node, expert), quota)  # [N, E]
    node_cross = node_room - jnp.minimum(node_supply, node_room)
    room, cross = node_room[rank_node, expert], node_cross[rank_node, expert]  # [R, S]
    share = jnp.floor(quota.astype(jnp.float32) * cross.astype(jnp.float32)
                      / jnp.maximum(room, 1).astype(jnp.float32)).astype(jnp.int32)
    return share.sum(1)


def locality_swaps(counts, placement, guests, quotas, cand, topology: Topology, dims: ExpertDims):
    """Fill free guest slots with pairs of swapped copies that keep every rank's load unchanged.

    Two hot experts e1 and e2 with home ranks h1 and h2 on different nodes: a copy of e1 on h2 takes
    a pairs of e1 from h2's node, and a copy of e2 on h1 takes a pairs of e2 from h1's node. Both
    ranks keep their load (each gives away a pairs and takes a), and 2a pairs stop crossing the
    scale-out link, at the price of two expert weights (and their gradients) crossing it; and each
    rank receives a pairs fewer across nodes. Swaps are made greedily while neither rank's weight
    transfers (sent and received) become the most exposed behind its home-slot GEMMs, the cost
    model's condition for a transfer to cost no time: first levelling swaps, with the rank whose
    estimated scale-out receive (scale_out_receive) is the largest, since the exchange waits for it,
    and the partner that receives the most after it; once that rank has none, the swap with the
    largest net saving of bytes, while one saves more than it ships.

    guests, quotas: [R, K] copies already made (expert id or -1, pairs each); cand: [C] the copy
    loop's candidates (spill_candidates), among which routing lists every guest's expert, so the
    swaps choose among them (at most R * K / 2 swaps fit). Returns guests and quotas extended.
    """
    num_ranks, num_experts = counts.shape
    slots = guests.shape[1]
    gpus_per_node = topology.gpus_per_node
    nodes = num_ranks // gpus_per_node
    pair_bytes = EXCHANGES_PER_LAYER * dims.pair_bytes
    copy_bytes = 2.0 * dims.expert_bytes
    link_s, pair_fwd_s, _, _ = transfer_costs(topology, dims)  # [R, R] seconds to ship one expert
    loads = counts.sum(0)
    home_rank = home_rank_of_experts(placement)
    home_node = home_rank // gpus_per_node
    occupied = guests >= 0
    taken = scatter_add((num_experts,), (jnp.maximum(guests, 0),), jnp.where(occupied, quotas, 0))
    # The swap search runs on SWAP_CANDIDATES of the copy loop's candidates (routing lists only
    # those): the one with the most pairs left at home on each of the ranks that receive the most
    # across nodes. Those ranks set the exchange term, and a rank's hottest expert has the most pairs
    # that a copy on another node can keep there. A rank without a candidate is listed with none
    # left, which no swap can move.
    recv = scale_out_receive(counts, placement, guests, quotas, gpus_per_node)
    left = (loads - taken)[cand]
    mine = home_rank[cand][None, :] == jnp.arange(num_ranks)[:, None]  # [R, C]
    best = first_argmax(jnp.where(mine, left[None, :], -1), axis=1)  # [R]
    has = mine.any(1)
    bound = key_range(num_ranks)
    chosen = stable_order(descending_key(jnp.where(has, recv + 1, 0), bound), bound)
    chosen = chosen[:min(num_ranks, cand.shape[0], SWAP_CANDIDATES)]
    cand, left = cand[best[chosen]], jnp.where(has[chosen], left[best[chosen]], 0)
    num_cand = cand.shape[0]
    node_pairs = counts[:, cand].reshape(nodes, gpus_per_node, num_cand).sum(1)  # [N, C]
    # With locality-tiered routing a copy on node n is fed by node n's own pairs first.
    is_cand = guests[:, :, None] == cand[None, None, :]  # [R, K, C] guest slot holds the candidate
    served = (jnp.where(is_cand, quotas[:, :, None], 0).sum(1)
              .reshape(nodes, gpus_per_node, num_cand).sum(1))  # [N, C]
    remote = jnp.arange(nodes)[:, None] != home_node[cand][None, :]
    crossing = jnp.where(remote, jnp.maximum(node_pairs - served, 0), 0)  # [N, C]
    # Weight-transfer seconds each rank is already busy with over each link class, [NVLink, across
    # nodes] x R: the larger of what it sends (as a home) and receives (as a guest host); the
    # classes run at once, as the cost model prices them. And the home-slot forward GEMM seconds that
    # can hide them.
    ranks = jnp.broadcast_to(jnp.arange(num_ranks)[:, None], guests.shape)
    src = home_rank[jnp.maximum(guests, 0)]
    # Counted in whole transfers per link class, then priced: no float scatter-add, whose order
    # (and so whose rounding) could differ between devices.
    inter = node_link_class(topology)[src, ranks]
    busy = []
    for link_class, bandwidth in ((False, topology.intra_bw), (True, topology.inter_bw)):
        mine = occupied & (inter == link_class)
        seconds = jnp.float32(dims.expert_bytes / bandwidth)
        sent = scatter_add((num_ranks,), (src,), mine.astype(jnp.int32)).astype(jnp.float32) * seconds
        busy.append(jnp.maximum(sent, mine.sum(1).astype(jnp.float32) * seconds))
    busy = jnp.stack(busy)  # [2, R]
    hide = (loads - taken)[placement].sum(1).astype(jnp.float32) * pair_fwd_s
    cand_rank = home_rank[cand]  # [C]
    cand_node = home_node[cand]
    holds = holds_home(cand_rank, num_ranks) | is_cand.any(1)  # [R, C]
    rank_ids = jnp.arange(num_ranks, dtype=jnp.int32)
    # Invariant over the loop: what shipping one expert between the two homes costs, and which
    # pairs of candidates live on different nodes.
    cost = link_s[cand_rank[:, None], cand_rank[None, :]]
    apart = cand_node[:, None] != cand_node[None, :]
    state = (jnp.int32(0), guests, quotas, occupied.sum(1).astype(jnp.int32), holds,
             crossing, left, busy, hide, recv)
    state = carry_like(state, counts)

    def step(state):
        i, guests, quotas, used, holds, crossing, left, busy, hide, recv = state
        pull = crossing[cand_node, :]  # [e2, e1]: pairs of e1 from e2's home node
        amount = jnp.minimum(jnp.minimum(pull.T, pull), jnp.minimum(left[:, None], left[None, :]))  # [e1, e2]
        free = used[cand_rank] < slots
        fits = free[:, None] & free[None, :] & ~holds[cand_rank, :] & ~holds[cand_rank, :].T & apart
        # Each rank sends one expert and receives one more; its home slots lose `amount` pairs.
        after = hide[cand_rank][:, None] - amount.astype(jnp.float32) * pair_fwd_s
        # Both transfers of a swap cross nodes (`apart`); each home's NVLink transfers run beside them.
        loaded = jnp.maximum(busy[0][cand_rank][:, None], busy[1][cand_rank][:, None] + cost)  # [e1, e2] at h1
        # The cost model charges the most exposed rank's transfers, forward and backward: a swap
        # costs no time while neither rank's exposure rises above those maxima.
        slowest = busy.max(0)
        fwd_max = jnp.maximum((slowest - hide).max(), 0.0)
        bwd_max = jnp.maximum((slowest - 2.0 * hide).max(), 0.0)
        hidden = ((loaded - after <= fwd_max) & (loaded - 2.0 * after <= bwd_max)
                  & (loaded.T - after.T <= fwd_max) & (loaded.T - 2.0 * after.T <= bwd_max))
        allowed = fits & hidden & (amount > 0)
        gain = jnp.where(allowed, 2.0 * amount.astype(jnp.float32) * pair_bytes - 2.0 * copy_bytes, -jnp.inf)
        # Levelling swaps: one with the rank that receives the most across nodes, which sets the
        # exchange term, whatever the bytes; the partner that receives the most next, then the
        # largest amount, first.
        top = first_argmax(recv)
        at_top = (cand_rank == top)[:, None] | (cand_rank == top)[None, :]
        partner = jnp.minimum(recv[cand_rank][:, None], recv[cand_rank][None, :]).astype(jnp.float32)
        level = jnp.where(allowed & at_top, partner + amount.astype(jnp.float32) / (amount.max() + 1.0), -jnp.inf)
        levels = level.max() > -jnp.inf
        flat = jnp.where(levels, first_argmax(level), first_argmax(gain))
        e1, e2 = flat // num_cand, flat % num_cand
        ok = levels | (gain.reshape(-1)[flat] > 0)
        a = jnp.where(ok, amount[e1, e2], 0)
        h1, h2 = cand_rank[e1], cand_rank[e2]
        # A copy of e1 into h2's next free slot and one of e2 into h1's (where ok; else each entry is
        # written back as it is), one entry at a time (common.set_entry).
        for rank, e, other in ((h2, e1, e2), (h1, e2, e1)):
            j = jnp.minimum(used[rank], slots - 1)
            guests = set_entry(guests, (rank, j), jnp.where(ok, cand[e], guests[rank, j]))
            quotas = set_entry(quotas, (rank, j), jnp.where(ok, a, quotas[rank, j]))
            holds = set_entry(holds, (rank, e), holds[rank, e] | ok)
            crossing = set_entry(crossing, (cand_node[other], e), crossing[cand_node[other], e] - a)
        swapped = ok & ((rank_ids == h1) | (rank_ids == h2))
        used = used + swapped.astype(jnp.int32)
        cols = jnp.arange(num_cand)
        left = left - jnp.where((cols == e1) | (cols == e2), a, 0)
        busy = busy + jnp.where((jnp.arange(2)[:, None] == 1) & swapped[None, :], link_s[h1, h2], 0.0)
        hide = hide - jnp.where(swapped, a.astype(jnp.float32) * pair_fwd_s, 0.0)
        recv = jnp.maximum(recv - jnp.where(swapped, a, 0), 0)
        return (jnp.where(ok, i + 1, num_ranks * slots), guests, quotas, used, holds, crossing, left, busy,
                hide, recv)

    # At most R * K / 2 swaps; the exit test reads values identical on every device.
    state = step_until_done(step, state, lambda st: st[0], (num_ranks * slots) // 2)
    return state[1], state[2]
