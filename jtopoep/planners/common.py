"""Pieces every planner shares: loads and targets, spill, quotas, and locality-tiered token routing.

Loads, spill, quotas and routing are integer-only and written against an array namespace `xp`
(jax.numpy inside jit, numpy for the host planner), so the device and host versions of a planner
agree bit for bit. Pricing copies (TransferClock, locality swaps) uses float32 seconds and bytes,
computed in the same order on every device.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims, copy_break_even_pairs
from jtopoep.ordering import descending_key, key_range, stable_order
from jtopoep.plan import Plan, home_plan
from jtopoep.topology import Topology

# The locality swaps search the hottest candidates only; see locality_swaps.
SWAP_CANDIDATES = 16


@dataclasses.dataclass(frozen=True)
class PlannerBase:
    """Static settings shared by every planner. Subclasses implement `_plan(counts, placement)`.

    min_gain: a copy must save at least min_gain x the time of shipping its weights out and its
    gradients back (copy_break_even_pairs), ignoring any overlap; 0 turns the check off. It needs `dims`.
    """

    topology: Topology
    num_experts: int
    guest_slots: int
    min_gain: float = 0.0
    dims: ExpertDims | None = None
    # Refuse copies that expose more weight-transfer time than the GEMM time they save (cost model,
    # TransferClock). False balances load regardless of transfer cost. Needs dims to have an effect.
    price_transfers: bool = True

    def __post_init__(self):
        ranks = self.topology.num_ranks
        if self.num_experts < 1 or self.num_experts % ranks:
            raise ValueError(f"num_experts = {self.num_experts} must be a positive multiple of the "
                             f"{ranks} ranks of the topology")
        if self.guest_slots < 0:
            raise ValueError(f"guest_slots = {self.guest_slots} must be >= 0")
        if self.min_gain < 0:
            raise ValueError(f"min_gain = {self.min_gain} must be >= 0")
        if self.min_gain > 0 and self.dims is None:
            raise ValueError("min_gain > 0 needs dims (ExpertDims) to price a copy's weight transfer")

    @property
    def num_ranks(self) -> int:
        return self.topology.num_ranks

    def transfer_costs(self):
        """(link seconds [R, R], forward and forward+backward seconds per pair) for pricing copies."""
        return transfer_costs(self.topology, self.dims if self.price_transfers else None)

    @property
    def home_slots(self) -> int:
        return self.num_experts // self.num_ranks

    def gain_thresholds(self) -> tuple[float, float]:
        """Least pairs a copy must take over an (intra-node, inter-node) link to be worth making."""
        if self.min_gain == 0:
            return 0.0, 0.0
        intra, inter = copy_break_even_pairs(self.topology, self.dims)
        return self.min_gain * intra, self.min_gain * inter

    def __call__(self, counts, placement=None) -> Plan:
        num_ranks, num_experts = counts.shape
        if (num_ranks, num_experts) != (self.num_ranks, self.num_experts):
            raise ValueError(f"counts has shape {counts.shape}; this planner expects "
                             f"({self.num_ranks}, {self.num_experts})")
        if placement is None:
            placement = jnp.arange(num_experts, dtype=jnp.int32).reshape(num_ranks, self.home_slots)
        counts, placement = jnp.asarray(counts, jnp.int32), jnp.asarray(placement, jnp.int32)
        if self.guest_slots == 0:  # no slot to copy into: every planner reduces to the home plan
            return home_plan(counts, placement, 0)
        return self._plan(counts, placement)

    def _plan(self, counts, placement) -> Plan:
        raise NotImplementedError


def carry_like(state, ref):
    """The loop state with the same device-variance as `ref`.

    Inside shard_map, counts all-gathered over the mesh are typed as varying over its axes, and a
    loop carry must keep one type: constants in the initial state are made to vary the same way by
    adding a zero derived from `ref`."""
    zero = ref.reshape(-1)[:1].sum() * 0
    return jax.tree.map(lambda x: x | (zero != 0) if x.dtype == bool else x + zero.astype(x.dtype), state)


def home_rank_of_experts(placement, xp=jnp):
    """[E] home rank of each expert under the placement (a permutation of the experts)."""
    num_ranks, home = placement.shape
    ranks = xp.repeat(xp.arange(num_ranks, dtype=xp.int32), home)
    return _scatter_set(num_ranks * home, placement.reshape(-1), ranks, xp)


def holds_home(home_rank, num_ranks: int, xp=jnp):
    """[R, n] True where the rank is the home of each of n experts, given their home ranks [n]."""
    return home_rank[None, :] == xp.arange(num_ranks, dtype=xp.int32)[:, None]


def _scatter_set(size: int, index, values, xp):
    """zeros(size) with values written at index; every index at most once, so order cannot matter.
    A scatter of n values costs n, where a one-hot reduction costs n * size."""
    if xp is np:
        out = np.zeros(size, values.dtype)
        out[index] = values
        return out
    return jnp.zeros(size, values.dtype).at[index].set(values, unique_indices=True)


def one_hot(ids, n, xp=jnp):
    """int32 one-hot of ids along a new last axis; id -1 gives an all-zero row."""
    return (ids[..., None] == xp.arange(n, dtype=xp.int32)).astype(xp.int32)


def ceil_div(a, b):
    return -(-a // b)


def spill_per_expert(loads, placement, target, xp=jnp):
    """[E] pairs above target on each rank, attributed to its home experts hottest first (ties to
    the lower slot)."""
    home_loads = loads[placement]  # [R, H]
    slot = xp.arange(placement.shape[1])
    mine, other = home_loads[:, :, None], home_loads[:, None, :]
    # Pairs of the rank's experts that shed before each one: a pairwise count over the H home
    # slots, which is cheaper than a per-row sort for the few slots a rank has.
    ahead = (other > mine) | ((other == mine) & (slot[None, None, :] < slot[None, :, None]))  # [R, H, H]
    before = (ahead * other).sum(2)
    excess = xp.maximum(home_loads.sum(1) - target, 0)[:, None]
    spill = xp.minimum(home_loads, xp.maximum(excess - before, 0))
    return _scatter_set(loads.shape[0], placement.reshape(-1), spill.reshape(-1).astype(loads.dtype), xp)


def num_copy_candidates(num_experts: int, num_ranks: int, guest_slots: int) -> int:
    """How many experts a copy loop considers: min(E, R * K, R).

    Spill is attributed to each overloaded rank's hottest experts first, so each rank's spill spans
    few experts: the load families in benchmarks/ have at most 28 spilling experts on 32 ranks. With
    more than R, the ones with the least spill keep it at home (a plan that is less balanced, never
    a lost pair). Capping at R halves taot's per-step [C, R] work at K = 2 (about 800 -> 500 us on
    this CPU) for the same plans on every benchmark family."""
    return min(num_experts, num_ranks * guest_slots, num_ranks)


def spill_candidates(spill, loads, num: int):
    """The `num` experts with the most spill, ties by load, then by lowest index.

    A copy loop copies experts among these only (num = num_copy_candidates(...)), so its cost does
    not grow with E. The hottest non-spilling experts
    fill the list after the spilling ones, which is what the locality swaps look at. Two packed
    single-key sorts (jtopoep.ordering) instead of one sort with two keys and a payload."""
    bound = key_range(spill.shape[0])  # counts of pairs stay far below it (8M for E = 256)
    by_load = stable_order(descending_key(loads, bound), bound)
    # A stable sort by spill of the experts in load order keeps load order among equal spills.
    return by_load[stable_order(descending_key(spill[by_load], bound), bound)][:num]


def prefix_sum(x, axis: int = 0, xp=jnp):
    """Inclusive prefix sums along `axis`. XLA:CPU lowers jnp.cumsum to a reduce-window whose cost
    grows with the square of the axis; an associative scan does log2(n) passes instead (about 3x
    faster on a [32, 256] array here) and gives the same integers on any backend."""
    if xp is np:
        return np.cumsum(x, axis=axis)
    return jax.lax.associative_scan(jnp.add, x, axis=axis)


def scatter_add(shape, index: tuple, values, xp=jnp):
    """zeros(shape) with values added at index; integer, so the result does not depend on order."""
    if xp is np:
        out = np.zeros(shape, values.dtype)
        np.add.at(out, index, values)
        return out
    return jnp.zeros(shape, values.dtype).at[index].add(values)


def even_quotas(slot_expert, loads, xp=jnp):
    """[R, S] split each expert's load evenly over its copies; the first copies in (d, j) order take
    one pair more when the load does not divide."""
    num_ranks, num_slots = slot_expert.shape
    flat = slot_expert.reshape(-1)
    hot = one_hot(flat, loads.shape[0], xp)  # [R*S, E]
    copies = hot.sum(0)  # [E]
    index_in_expert = ((prefix_sum(hot, 0, xp) - hot) * hot).sum(1)
    safe = xp.maximum(flat, 0)
    n = xp.maximum(copies[safe], 1)
    quota = loads[safe] // n + (index_in_expert < loads[safe] % n).astype(xp.int32)
    return xp.where(flat >= 0, quota, 0).reshape(num_ranks, num_slots).astype(xp.int32)


def _overlap(s_hi, supply, c_hi, capacity, xp):
    """Length of the overlap of the intervals [s_hi - supply, s_hi) and [c_hi - capacity, c_hi)."""
    return xp.maximum(xp.minimum(s_hi, c_hi) - xp.maximum(s_hi - supply, c_hi - capacity), 0)


def _segment_prefix(values, segment, xp):
    """Inclusive prefix sums of `values` that restart wherever `segment` changes (both in sorted order)."""
    total = prefix_sum(values, 0, xp)
    index = xp.arange(values.shape[0])
    starts = xp.concatenate([xp.ones(1, bool), segment[1:] != segment[:-1]])
    marked = xp.where(starts, index, 0)
    first = np.maximum.accumulate(marked) if xp is np else jax.lax.cummax(marked)
    return total - (total - values)[first]


def _unsort(sorted_values, order, xp):
    """The values in their original order, given them sorted by `order` (a permutation)."""
    if xp is np:
        out = np.empty_like(sorted_values)
        out[order] = sorted_values
        return out
    return jnp.zeros_like(sorted_values).at[order].set(sorted_values)


def plan_from_quotas(counts, slot_expert, quota, gpus_per_node: int, tiered: bool, xp=jnp) -> Plan:
    """The plan for given slot contents and per-slot quotas: every slot takes exactly its quota.

    Greedy transport by interval overlap, per expert: lay its sources (rank order) and its copies
    (rank order) end to end on one line each, by prefix sums, and send along the overlap of their
    intervals. With tiered=True a source first fills the copy on its own rank, then copies on its
    own node (prefix sums that restart at each node), then anywhere, each tier on what the previous
    left; tiered=False is the topology-oblivious split.

    Only experts with guest copies need this; every other expert sends all its pairs to its home
    slot. The transport runs on the m = 2 * R * K slots that can hold such copies (the guest slots,
    and the home slot of each guest's expert, listed once), laid out per source and slot, [R, m]:
    its cost grows with the guest slots, not with E or with the square of the ranks. Requires
    sum of quotas per expert == its load: every pair lands and nothing is invented."""
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
    home_slot = _scatter_set(num_experts, slot_expert[:, :home].reshape(-1), slot_of[:, :home].reshape(-1), xp)
    guest = slot_expert[:, home:].reshape(-1)  # [R*K]
    num_guests = guest.shape[0]
    same = (guest[:, None] == guest[None, :]) & (guest >= 0)[:, None]
    # Experts with guests get compact ids: the index of their first guest slot. The transport works on
    # [R, R * K] arrays of those, not [R, E].
    compact_of_guest = xp.argmax(same, axis=1).astype(xp.int32)
    first = (guest >= 0) & (compact_of_guest == xp.arange(num_guests))
    listed = xp.concatenate([slot_of[:, home:].reshape(-1), xp.where(first, home_slot[xp.maximum(guest, 0)], -1)])
    m = listed.shape[0]
    ids = xp.arange(m, dtype=xp.int32)
    valid = xp.concatenate([guest >= 0, first])
    safe = xp.concatenate([compact_of_guest, xp.arange(num_guests, dtype=xp.int32)])  # compact id per entry
    capacity = xp.where(valid, quota.reshape(-1)[xp.maximum(listed, 0)], 0).astype(xp.int32)  # [m]
    rank = xp.maximum(listed, 0) // num_slots
    node = rank // gpus_per_node
    num_nodes = num_ranks // gpus_per_node
    # Copies of one expert in rank order (a rank holds at most one copy of an expert); unused entries
    # last, each its own segment.
    by_expert = xp.where(valid, safe * num_ranks + rank, num_guests * num_ranks + ids)
    order = stable_order(by_expert, num_guests * num_ranks + m, xp)
    segment = xp.where(valid, safe, num_guests + ids)[order]

    def copy_prefix(cap, seg):  # [m] end of each copy's interval among its expert's copies (in seg)
        return _unsort(_segment_prefix(cap[order], seg, xp), order, xp)

    sources = xp.arange(num_ranks)
    flow = xp.zeros((num_ranks, m), xp.int32)  # [source, listed slot]
    supply = xp.where((guest >= 0)[None, :], counts[:, xp.maximum(guest, 0)], 0)  # [R, R*K] by compact id
    if tiered:
        local = xp.where(valid, xp.minimum(supply[rank, safe], capacity), 0)
        supply = supply - scatter_add((num_ranks, num_guests), (rank, safe), local, xp)
        capacity = capacity - local
        flow = flow + xp.where(sources[:, None] == rank[None, :], local[None, :], 0)
        # Within the node: the node's sources and copies, prefix sums restarting at each node.
        src = node[:, None] * gpus_per_node + xp.arange(gpus_per_node)[None, :]  # [m, G]
        node_supply = supply[src, safe[:, None]]
        s_hi = prefix_sum(node_supply, 1, xp)
        c_hi = copy_prefix(capacity, xp.where(valid, safe * num_nodes + node, num_guests * num_nodes + ids)[order])
        in_node = _overlap(s_hi, node_supply, c_hi[:, None], capacity[:, None], xp)  # [m, G]
        supply = supply - scatter_add((num_ranks, num_guests), (src, xp.broadcast_to(safe[:, None], src.shape)),
                                      in_node, xp)
        capacity = capacity - in_node.sum(1)
        same_node = (sources // gpus_per_node)[:, None] == node[None, :]
        flow = flow + xp.where(same_node, in_node.T[sources % gpus_per_node], 0)
    supply = supply[:, safe]  # [R, m]
    anywhere = _overlap(prefix_sum(supply, 0, xp), supply, copy_prefix(capacity, segment)[None, :],
                        capacity[None, :], xp)
    flow = xp.where(valid[None, :], flow + anywhere, 0)
    # Written into the listed slots' columns by a scatter, which makes XLA compute `flow` once; as a
    # gather it fused the whole transport into every element of the route (3x slower on CPU). Each
    # slot is listed at most once; unused entries point past the end, each somewhere else, and drop.
    column = xp.where(listed >= 0, listed, n + ids)
    if xp is np:
        route = base.copy()
        route[:, listed[listed >= 0]] = flow[:, listed >= 0]
    else:
        route = base.at[:, column].set(flow, mode="drop", unique_indices=True)
    return Plan(slot_expert.astype(xp.int32), route.reshape(num_ranks, num_ranks, num_slots).astype(xp.int32))


def guest_quotas_to_slots(placement, guest_expert, guest_quota, loads, xp=jnp):
    """Slots [R, S] and quotas [R, S] from guest copies: each home slot keeps what its guests do not take."""
    num_experts = loads.shape[0]
    slot_expert = xp.concatenate([placement, guest_expert], axis=1).astype(xp.int32)
    taken = scatter_add((num_experts,), (xp.maximum(guest_expert, 0),), xp.where(guest_expert >= 0, guest_quota, 0), xp)
    home_quota = loads[placement] - taken[placement]
    return slot_expert, xp.concatenate([home_quota, guest_quota], axis=1).astype(xp.int32)


def uncovered_node_pairs(counts, loads, spill, cand, cand_home, gpus_per_node: int):
    """[N, C] pairs of each candidate expert from each node that no copy on that node takes yet: on
    remote nodes all of them (they cross the scale-out link to the home), on the home node those
    beyond what the home slot keeps after spilling. A copy placed on node n and fed by n's own pairs
    (locality-tiered routing) turns up to this many pairs into intra-node traffic."""
    node_pairs = counts[:, cand].reshape(-1, gpus_per_node, cand.shape[0]).sum(1).astype(jnp.float32)
    remote = jnp.arange(node_pairs.shape[0])[:, None] != (cand_home // gpus_per_node)[None, :]
    kept = (loads[cand] - spill[cand]).astype(jnp.float32)
    return jnp.where(remote, node_pairs, jnp.maximum(node_pairs - kept[None, :], 0.0))


def node_link_class(topology: Topology, xp=jnp):
    """[R, R] True where the two ranks are on different nodes."""
    node = xp.arange(topology.num_ranks) // topology.gpus_per_node
    return node[:, None] != node[None, :]


class TransferClock(NamedTuple):
    """Per-rank seconds of guest-weight transfer against the home-slot GEMM time that hides them.

    The cost model's rule: weights a rank sends (as home) or receives (as host) are free while they
    fit behind its home-slot forward GEMMs, and gradients going back behind its backward (twice the
    forward); only the rest is exposed. Planners use it to price a copy before making it."""
    send: jnp.ndarray  # [R] seconds of weights sent
    recv: jnp.ndarray  # [R] seconds of weights received
    hide: jnp.ndarray  # [R] seconds of home-slot forward GEMM


def transfer_costs(topology: Topology, dims: ExpertDims | None):
    """(seconds to ship one expert between each pair of ranks [R, R], forward seconds per pair,
    forward+backward seconds per pair); zeros without dims, which makes every copy free."""
    num_ranks = topology.num_ranks
    if dims is None:
        return jnp.zeros((num_ranks, num_ranks), jnp.float32), 0.0, 0.0
    rate = topology.flops * topology.mfu
    link_s = jnp.where(node_link_class(topology), dims.expert_bytes / topology.inter_bw,
                       dims.expert_bytes / topology.intra_bw).astype(jnp.float32)
    return link_s, dims.pair_flops / 3.0 / rate, dims.pair_flops / rate


def _exposed(send, recv, hide):
    """(forward, backward) exposed transfer seconds: weights out behind the home forward GEMMs,
    gradients back behind the backward (twice the forward)."""
    busy = jnp.maximum(send, recv)
    return jnp.maximum(busy - hide, 0.0), jnp.maximum(busy - 2.0 * hide, 0.0)


def copy_exposure(clock: TransferClock, home, dest, link, moved_fwd_s):
    """Extra layer seconds from the guest-weight term if `home` ships one expert to `dest` (link
    seconds) and its home slots lose moved_fwd_s of forward GEMM. The cost model charges the most
    exposed rank, forward and backward, so a transfer costs only what it adds to those maxima.
    Broadcasts over candidate arrays."""
    fwd, bwd = _exposed(clock.send, clock.recv, clock.hide)
    fwd_max, bwd_max = fwd.max(), bwd.max()
    home_fwd, home_bwd = _exposed(clock.send[home] + link, clock.recv[home], clock.hide[home] - moved_fwd_s)
    dest_fwd, dest_bwd = _exposed(clock.send[dest], clock.recv[dest] + link, clock.hide[dest])
    return (jnp.maximum(jnp.maximum(home_fwd, dest_fwd) - fwd_max, 0.0)
            + jnp.maximum(jnp.maximum(home_bwd, dest_bwd) - bwd_max, 0.0))


def clock_after_copy(clock: TransferClock, home, dest, link, moved_fwd_s, ok) -> TransferClock:
    ranks = jnp.arange(clock.send.shape[0])
    at_home = ok & (ranks == home)
    at_dest = ok & (ranks == dest)
    return TransferClock(clock.send + jnp.where(at_home, link, 0.0), clock.recv + jnp.where(at_dest, link, 0.0),
                         clock.hide - jnp.where(at_home, moved_fwd_s, 0.0))


class CopyState(NamedTuple):
    """The state of a copy-placement loop over C candidate experts (one copy per step)."""
    step: jnp.ndarray  # i32 scalar; set to the loop bound to stop early
    spill: jnp.ndarray  # [C] pairs each candidate still has to shed
    room: jnp.ndarray  # [R] pairs each rank can still take below the target
    used: jnp.ndarray  # [R] guest slots filled
    holds: jnp.ndarray  # [R, C] rank holds the candidate (home or guest)
    guests: jnp.ndarray  # [R, K] expert id of each guest slot, -1 empty
    quotas: jnp.ndarray  # [R, K] pairs each guest slot takes
    clock: TransferClock


def start_copies(counts, placement, cand, spill, target, slots: int, pair_fwd_s: float) -> CopyState:
    num_ranks, num_experts = counts.shape
    rank_loads = counts.sum(0)[placement].sum(1)
    state = CopyState(
        jnp.int32(0), spill[cand], jnp.maximum(target - rank_loads, 0), jnp.zeros(num_ranks, jnp.int32),
        holds_home(home_rank_of_experts(placement)[cand], num_ranks), jnp.full((num_ranks, slots), -1, jnp.int32),
        jnp.zeros((num_ranks, slots), jnp.int32),
        TransferClock(jnp.zeros(num_ranks), jnp.zeros(num_ranks), rank_loads.astype(jnp.float32) * pair_fwd_s))
    return carry_like(state, counts)


def make_copy(state: CopyState, e, d, amount, ok, cand, home, link, pair_fwd_s: float) -> CopyState:
    """Put a copy of candidate e on rank d taking `amount` pairs off its home rank, where ok."""
    num_ranks, slots = state.guests.shape
    amount = jnp.where(ok, amount, 0)
    at_d = ok & (jnp.arange(num_ranks) == d)
    put = at_d[:, None] & (jnp.arange(slots)[None, :] == state.used[d])
    is_e = jnp.arange(state.spill.shape[0]) == e
    return state._replace(
        spill=state.spill - jnp.where(is_e, amount, 0),
        room=state.room - jnp.where(at_d, amount, 0),
        used=state.used + at_d.astype(jnp.int32),
        holds=state.holds | (at_d[:, None] & is_e[None, :]),
        guests=jnp.where(put, cand[e], state.guests),
        quotas=jnp.where(put, amount, state.quotas),
        clock=clock_after_copy(state.clock, home, d, link, amount.astype(jnp.float32) * pair_fwd_s, ok))


def finish_plan(planner: PlannerBase, counts, placement, state: CopyState, cand) -> Plan:
    """Locality swaps among the candidates into the slots left (they need expert shapes to be
    priced), then the plan."""
    guests, quotas = state.guests, state.quotas
    if planner.dims is not None:
        guests, quotas = locality_swaps(counts, placement, guests, quotas, cand, planner.topology, planner.dims)
    slot_expert, quota = guest_quotas_to_slots(placement, guests, quotas, counts.sum(0))
    return plan_from_quotas(counts, slot_expert, quota, planner.topology.gpus_per_node, True, jnp)


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
    link_s, pair_fwd_s, _ = transfer_costs(topology, dims)  # [R, R] seconds to ship one expert
    loads = counts.sum(0)
    home_rank = home_rank_of_experts(placement)
    home_node = home_rank // gpus_per_node
    occupied = guests >= 0
    taken = scatter_add((num_experts,), (jnp.maximum(guests, 0),), jnp.where(occupied, quotas, 0))
    left = (loads - taken)[cand]
    # Only the hottest can pay for two weight transfers (each swap moves at most what is left of
    # both experts): the swap search runs on the SWAP_CANDIDATES with the most pairs left.
    hot = stable_order(descending_key(left, key_range(cand.shape[0])), key_range(cand.shape[0]))
    hot = hot[:min(cand.shape[0], SWAP_CANDIDATES)]
    cand, left = cand[hot], left[hot]
    num_cand = cand.shape[0]
    node_pairs = counts[:, cand].reshape(nodes, gpus_per_node, num_cand).sum(1)  # [N, C]
    # With locality-tiered routing a copy on node n is fed by node n's own pairs first.
    served = (jnp.where(guests[:, :, None] == cand[None, None, :], quotas[:, :, None], 0).sum(1)
              .reshape(nodes, gpus_per_node, num_cand).sum(1))  # [N, C]
    remote = jnp.arange(nodes)[:, None] != home_node[cand][None, :]
    crossing = jnp.where(remote, jnp.maximum(node_pairs - served, 0), 0)  # [N, C]
    # Weight-transfer seconds each rank already sends (as a home) and receives (as a guest host), and
    # the home-slot forward GEMM seconds that can hide them.
    ranks = jnp.broadcast_to(jnp.arange(num_ranks)[:, None], guests.shape)
    src = home_rank[jnp.maximum(guests, 0)]
    # Counted in whole transfers per link class, then priced: no float scatter-add, whose order
    # (and so whose rounding) could differ between devices.
    inter = node_link_class(topology)[src, ranks]
    sent = jnp.zeros(num_ranks, jnp.float32)
    received = jnp.zeros(num_ranks, jnp.float32)
    for link_class, bandwidth in ((False, topology.intra_bw), (True, topology.inter_bw)):
        mine = occupied & (inter == link_class)
        seconds = jnp.float32(dims.expert_bytes / bandwidth)
        sent = sent + scatter_add((num_ranks,), (src,), mine.astype(jnp.int32)).astype(jnp.float32) * seconds
        received = received + mine.sum(1).astype(jnp.float32) * seconds
    busy = jnp.maximum(sent, received)
    hide = (loads - taken)[placement].sum(1).astype(jnp.float32) * pair_fwd_s
    cand_rank = home_rank[cand]  # [C]
    cand_node = home_node[cand]
    holds = holds_home(cand_rank, num_ranks) | (guests[:, :, None] == cand[None, None, :]).any(1)  # [R, C]
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
        hidden = (busy[cand_rank][:, None] + cost <= after) & (busy[cand_rank][None, :] + cost <= after.T)
        gain = jnp.where(fits & hidden & (amount > 0),
                         2.0 * amount.astype(jnp.float32) * pair_bytes - 2.0 * copy_bytes, -jnp.inf)
        flat = jnp.argmax(gain.reshape(-1))
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
        busy = busy + jnp.where(swapped, link_s[h1, h2], 0.0)
        hide = hide - jnp.where(swapped, a.astype(jnp.float32) * pair_fwd_s, 0.0)
        return (jnp.where(ok, i + 1, num_ranks * slots), guests, quotas, used, holds, crossing, left, busy,
                hide)

    # At most R * K / 2 swaps; the exit test reads values identical on every device.
    state = jax.lax.while_loop(lambda st: st[0] < (num_ranks * slots) // 2, step, state)
    return state[1], state[2]
