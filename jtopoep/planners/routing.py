"""Locality-tiered token routing: which source sends how many pairs of each expert to each copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.ordering import first_argmax
from jtopoep.plan import Plan
from jtopoep.planners.common import prefix_sum, scatter_add, scatter_set


def _overlap(s_hi, supply, c_hi, capacity, xp):
    """Length of the overlap of the intervals [s_hi - supply, s_hi) and [c_hi - capacity, c_hi)."""
    return xp.maximum(xp.minimum(s_hi, c_hi) - xp.maximum(s_hi - supply, c_hi - capacity), 0)


def _nonnegative_div(a, b: int, xp):
    """a // b for a >= 0: one truncating division. jnp's floor division adds sign fix-ups that
    XLA then repeats in every element of the [m, m] and [R, m] kernels these indices feed."""
    return a // b if xp is np else jax.lax.div(a, jnp.asarray(b, a.dtype))


def plan_from_quotas(counts, slot_expert, quota, gpus_per_node: int, tiered: bool, xp=jnp, experts=None) -> Plan:
    """The plan for given slot contents and per-slot quotas: every slot takes exactly its quota.

    Greedy transport by interval overlap, per expert: lay its sources (rank order) and its copies
    (rank order) end to end on one line each, by prefix sums, and send along the overlap of their
    intervals. With tiered=True a source first fills the copy on its own rank, then copies on its
    own node (the pairs a node keeps are shared among its copies in proportion to their capacity
    and taken from its sources in proportion to their supply), then anywhere, each tier on what
    the previous left; tiered=False is the topology-oblivious split.

    Only experts with guest copies need this; every other expert sends all its pairs to its home
    slot. The transport runs on the m = 2 * R * K slots that can hold such copies (the guest slots,
    and the home slot of each guest's expert, listed once), laid out per source and slot, [R, m]:
    its cost grows with the guest slots, not with E or with the square of the ranks. Requires
    sum of quotas per expert == its load: every pair lands and nothing is invented.

    experts: optional [C] distinct expert ids among which every guest copy's expert is (a copy
    loop's candidates). Then the home slots listed are those C, m = R * K + C, and no pairwise
    search for the distinct guest experts is needed: with C = R and K = 2, a quarter fewer entries.
    The plan is the same either way."""
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
    else:
        compact_expert = experts.astype(xp.int32)  # [C]
        hit = guest[:, None] == compact_expert[None, :]
        compact_of_guest = ((hit * xp.arange(1, compact_expert.shape[0] + 1, dtype=xp.int32)).sum(1) - 1)
        listed_home = xp.ones(compact_expert.shape, bool)
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
        """([m] end of each copy's interval, [m] length of the whole line): the capacity of the
        copies of its expert on ranks first_rank .. its own (a rank holds at most one copy of an
        expert, so rank order is the copies' order), and on all `width` ranks from first_rank.
        Looked up in a [rank, expert] table of capacities, [m, width] elements, where a masked sum
        over all pairs of entries took [m, m] (and XLA:CPU split that over threads, which cost
        more than the sum)."""
        table = scatter_add((num_ranks, num_ids), (rank, safe), xp.where(valid, cap, 0), xp)
        at = first_rank[:, None] + xp.arange(width, dtype=xp.int32)[None, :]  # [m, width]
        mine = table[xp.minimum(at, num_ranks - 1), safe[:, None]]
        return xp.where(at <= rank[:, None], mine, 0).sum(1), mine.sum(1)

    sources = xp.arange(num_ranks)
    flow = xp.zeros((num_ranks, m), xp.int32)  # [source, listed slot]
    supply = xp.where((compact_expert >= 0)[None, :], counts[:, xp.maximum(compact_expert, 0)], 0)  # [R, ids]
    if tiered:
        local = xp.where(valid, xp.minimum(supply[rank, safe], capacity), 0)
        supply = supply - scatter_add((num_ranks, num_ids), (rank, safe), local, xp)
        capacity = capacity - local
        flow = flow + xp.where(sources[:, None] == rank[None, :], local[None, :], 0)
        # Within the node: the node's sources and copies, prefix sums restarting at each node. The
        # pairs the node keeps, min(its supply, its copies' capacity), are shared among its copies
        # in proportion to their capacity, so that every copy of the expert there takes the same
        # share of its pairs from the node. (Filling copies in rank order instead leaves the last
        # with remote pairs only, and the exchange waits for the rank that receives the most pairs
        # across nodes.) The share is a float32 product and quotient, floored, the same on every
        # device; a pair it leaves over goes through the anywhere tier.
        src = node[:, None] * gpus_per_node + xp.arange(gpus_per_node)[None, :]  # [m, G]
        node_supply = supply[src, safe[:, None]]
        s_hi = prefix_sum(node_supply, 1, xp)
        _, node_capacity = copy_prefix(capacity, node * gpus_per_node, gpus_per_node)
        kept = xp.minimum(s_hi[:, -1], node_capacity).astype(xp.float32)
        share = xp.floor(kept * capacity.astype(xp.float32) / xp.maximum(node_capacity, 1).astype(xp.float32))
        share = xp.minimum(share.astype(xp.int32), capacity)
        c_hi, taken = copy_prefix(share, node * gpus_per_node, gpus_per_node)
        # Likewise the node's sources give those pairs in proportion to their supply: source s's
        # interval on the line is [floor(taken x before / all), floor(taken x (before + its
        # supply) / all)), float32 as above and no longer than its supply. (Taking them in rank
        # order left the node's last sources to send all it cannot keep across nodes, and the
        # exchange waits for the rank that sends the most across nodes.)
        scale = taken.astype(xp.float32)[:, None] / xp.maximum(s_hi[:, -1:], 1).astype(xp.float32)
        g_lo = xp.floor(scale * (s_hi - node_supply).astype(xp.float32)).astype(xp.int32)
        g_hi = xp.minimum(xp.floor(scale * s_hi.astype(xp.float32)).astype(xp.int32), g_lo + node_supply)
        in_node = _overlap(g_hi, g_hi - g_lo, c_hi[:, None], share[:, None], xp)  # [m, G]
        supply = supply - scatter_add((num_ranks, num_ids), (src, xp.broadcast_to(safe[:, None], src.shape)),
                                      in_node, xp)
        capacity = capacity - in_node.sum(1)
        same_node = (sources // gpus_per_node)[:, None] == node[None, :]
        flow = flow + xp.where(same_node, in_node.T[sources % gpus_per_node], 0)
    supply = supply[:, safe]  # [R, m]
    c_hi, _ = copy_prefix(capacity, xp.zeros_like(rank), num_ranks)
    anywhere = _overlap(prefix_sum(supply, 0, xp), supply, c_hi[None, :], capacity[None, :], xp)
    flow = xp.where(valid[None, :], flow + anywhere, 0)
    # Written into the listed slots' columns by a scatter, which makes XLA compute `flow` once; as a
    # gather it fused the whole transport into every element of the route (3x slower on CPU). Each
    # slot is listed at most once; unused entries point past the end, each somewhere else, and drop.
    if xp is np:
        route = base.copy()
        route[:, listed[listed >= 0]] = flow[:, listed >= 0]
    else:
        column = jnp.where(listed >= 0, listed, n + ids)
        route = base.at[:, column].set(flow, mode="drop", unique_indices=True)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))
