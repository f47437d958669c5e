"""Load-neutral locality swaps: pairs of copies that turn crossing pairs into local ones."""

from __future__ import annotations

import jax.numpy as jnp

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims
from jtopoep.ordering import descending_key, first_argmax, key_range, stable_order
from jtopoep.plan import home_rank_of_experts
from jtopoep.planners.common import carry_like, holds_home, scatter_add
from jtopoep.planners.loops import step_until_done
from jtopoep.planners.pricing import node_link_class, transfer_costs
from jtopoep.topology import Topology

# The swap search runs on this many of the hottest candidates; see locality_swaps.
SWAP_CANDIDATES = 16


def locality_swaps(counts, placement, guests, quotas, cand, topology: Topology, dims: ExpertDims):
    """Fill free guest slots with pairs of swapped copies that keep every rank's load unchanged.

    Two hot experts e1 and e2 with home ranks h1 and h2 on different nodes: a copy of e1 on h2 takes
    a pairs of e1 from h2's node, and a copy of e2 on h1 takes a pairs of e2 from h1's node. Both
    ranks keep their load (each gives away a pairs and takes a), and 2a pairs stop crossing the
    scale-out link, at the price of two expert weights (and their gradients) crossing it. Swaps are
    made greedily, largest net saving first, while one saves more bytes than it ships and both
    ranks' weight transfers (sent and received) still hide behind their home-slot forward GEMMs, the
    cost model's condition for a transfer to cost no time.

    guests, quotas: [R, K] copies already made (expert id or -1, pairs each); cand: [C] the experts
    that may be swapped (spill_candidates: only the hottest can pay for two weight transfers, and at
    most R * K / 2 swaps fit). Returns guests and quotas extended.
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
    left = (loads - taken)[cand]
    # Only the hottest can pay for two weight transfers (each swap moves at most what is left of
    # both experts): the swap search runs on the SWAP_CANDIDATES with the most pairs left.
    bound = key_range(cand.shape[0])
    hot = stable_order(descending_key(left, bound), bound)[:min(cand.shape[0], SWAP_CANDIDATES)]
    cand, left = cand[hot], left[hot]
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
    slot_ids = jnp.arange(slots, dtype=jnp.int32)
    # Invariant over the loop: what shipping one expert between the two homes costs, and which
    # pairs of candidates live on different nodes.
    cost = link_s[cand_rank[:, None], cand_rank[None, :]]
    apart = cand_node[:, None] != cand_node[None, :]
    state = (jnp.int32(0), guests, quotas, occupied.sum(1).astype(jnp.int32), holds,
             crossing, left, busy, hide)
    state = carry_like(state, counts)

    def step(state):
        i, guests, quotas, used, holds, crossing, left, busy, hide = state
        pull = crossing[cand_node, :]  # [e2, e1]: pairs of e1 from e2's home node
        amount = jnp.minimum(jnp.minimum(pull.T, pull), jnp.minimum(left[:, None], left[None, :]))  # [e1, e2]
        free = used[cand_rank] < slots
        fits = free[:, None] & free[None, :] & ~holds[cand_rank, :] & ~holds[cand_rank, :].T & apart
        # Each rank sends one expert and receives one more; its home slots lose `amount` pairs.
        after = hide[cand_rank][:, None] - amount.astype(jnp.float32) * pair_fwd_s
        # Both transfers of a swap cross nodes (`apart`); each home's NVLink transfers run beside them.
        loaded = jnp.maximum(busy[0][cand_rank][:, None], busy[1][cand_rank][:, None] + cost)  # [e1, e2] at h1
        hidden = (loaded <= after) & (loaded.T <= after.T)
        gain = jnp.where(fits & hidden & (amount > 0),
                         2.0 * amount.astype(jnp.float32) * pair_bytes - 2.0 * copy_bytes, -jnp.inf)
        flat = first_argmax(gain)
        e1, e2 = flat // num_cand, flat % num_cand
        ok = gain.reshape(-1)[flat] > 0
        a = jnp.where(ok, amount[e1, e2], 0)
        h1, h2 = cand_rank[e1], cand_rank[e2]
        put1 = ok & (rank_ids[:, None] == h2) & (slot_ids[None, :] == used[h2])  # copy of e1 on h2
        put2 = ok & (rank_ids[:, None] == h1) & (slot_ids[None, :] == used[h1])  # copy of e2 on h1
        guests = jnp.where(put1, cand[e1], jnp.where(put2, cand[e2], guests))
        quotas = jnp.where(put1 | put2, a, quotas)
        swapped = ok & ((rank_ids == h1) | (rank_ids == h2))
        used = used + swapped.astype(jnp.int32)
        cols = jnp.arange(num_cand)
        holds = holds | (ok & (rank_ids[:, None] == h2) & (cols[None, :] == e1)) \
            | (ok & (rank_ids[:, None] == h1) & (cols[None, :] == e2))
        node_ids = jnp.arange(nodes)[:, None]
        crossing = crossing - jnp.where((node_ids == cand_node[e2]) & (cols[None, :] == e1), a, 0) \
            - jnp.where((node_ids == cand_node[e1]) & (cols[None, :] == e2), a, 0)
        left = left - jnp.where((cols == e1) | (cols == e2), a, 0)
        busy = busy + jnp.where((jnp.arange(2)[:, None] == 1) & swapped[None, :], link_s[h1, h2], 0.0)
        hide = hide - jnp.where(swapped, a.astype(jnp.float32) * pair_fwd_s, 0.0)
        return (jnp.where(ok, i + 1, num_ranks * slots), guests, quotas, used, holds, crossing, left, busy,
                hide)

    # At most R * K / 2 swaps; the exit test reads values identical on every device.
    state = step_until_done(step, state, lambda st: st[0], (num_ranks * slots) // 2)
    return state[1], state[2]
