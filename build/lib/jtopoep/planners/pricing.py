"""Pricing copies with the cost model: link classes, per-rank transfer clocks, exposed seconds.

Float32 seconds, computed in the same order on every device, from whole transfers and integer pair
counts (no float reduction whose order could vary).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jtopoep.costmodel import EXCHANGES_PER_LAYER, ExpertDims
from jtopoep.ordering import first_argmax
from jtopoep.topology import Topology


def node_link_class(topology: Topology, xp=jnp):
    """[R, R] True where the two ranks are on different nodes."""
    node = xp.arange(topology.num_ranks) // topology.gpus_per_node
    return node[:, None] != node[None, :]


class TransferClock(NamedTuple):
    """Per-rank seconds of guest-weight transfer against the home-slot GEMM time that hides them,
    and of the token exchange over the scale-out link.

    The cost model's rule: weights a rank sends (as home) or receives (as host) are free while they
    fit behind its home-slot forward GEMMs, and gradients going back behind its backward (twice the
    forward); only the rest is exposed. A rank's transfers take the longest of what it sends and
    receives over each link class: NVLink and the scale-out NICs are separate hardware and run at
    once, in full duplex (costmodel.copy_seconds_per_rank), so a copy to a rank of the same node
    costs a home whose NIC is busy nothing until its NVLink sends catch up. Planners use the clock
    to price a copy before making it. It prices whole copies: with the weights in slices
    (ExpertDims.weight_chunks) the cost model also hides a receiving rank's later slices behind its
    guest GEMMs of the earlier ones, so this is an upper bound on what a copy exposes (a rank that
    only sends gains nothing from slices).

    The exchange row tracks what the cost model charges for the token exchange where it binds: the
    scale-out receive of the ranks that host hot experts (pairs from other nodes). A copy on another
    rank takes pairs off its home's receive, which saves exchange time when that receive is the
    largest (exchange_saving); the largest send is kept as it starts, a floor under the saving.
    Planners keep these in seconds times their exchange_credit, so what they save is credited at that
    share.

    One [6, R] array rather than six: a copy updates it with one kernel and reads a rank's column
    with one gather, in loops that make one copy per step."""
    # [6, R] float32: weights sent over NVLink, sent across nodes, received over NVLink, received
    # across nodes, home-slot forward GEMM, scale-out exchange receive (all EXCHANGES_PER_LAYER
    # exchanges)
    seconds: jnp.ndarray
    exchange_floor: jnp.ndarray  # float32 scalar: the largest scale-out exchange send
    node: jnp.ndarray  # [R] int32 node of each rank: which link class a transfer takes

    @classmethod
    def start(cls, hide, exchange_recv, exchange_send, gpus_per_node: int):
        """Nothing sent or received yet; `hide` [R] seconds of home-slot forward GEMM, and each rank's
        scale-out exchange seconds received and sent with every pair at its home."""
        zero = jnp.zeros_like(hide)
        node = jnp.arange(hide.shape[0], dtype=jnp.int32) // gpus_per_node
        return cls(jnp.stack([zero, zero, zero, zero, hide, exchange_recv]), exchange_send.max(), node)

    @property
    def busy(self):  # [R] seconds each rank's slowest link class is busy with weights
        return self.seconds[:4].max(0)

    @property
    def hide(self):
        return self.seconds[4]

    @property
    def exchange_recv(self):
        return self.seconds[5]


def transfer_costs(topology: Topology, dims: ExpertDims | None):
    """(seconds to ship one expert between each pair of ranks [R, R], forward seconds per pair,
    forward+backward seconds per pair, scale-out exchange seconds per pair); zeros without dims,
    which makes every copy free."""
    num_ranks = topology.num_ranks
    if dims is None:
        return jnp.zeros((num_ranks, num_ranks), jnp.float32), 0.0, 0.0, 0.0
    rate = topology.flops * topology.mfu
    link_s = jnp.where(node_link_class(topology), dims.expert_bytes / topology.inter_bw,
                       dims.expert_bytes / topology.intra_bw).astype(jnp.float32)
    return (link_s, dims.pair_flops / 3.0 / rate, dims.pair_flops / rate,
            EXCHANGES_PER_LAYER * dims.pair_bytes / topology.inter_bw)


def home_exchange_seconds(counts, placement, topology: Topology, pair_xchg_s: float):
    """([R] scale-out exchange seconds each rank receives, [R] it sends) with every pair at its home."""
    to_home = counts[:, placement].sum(-1)  # [R(source), R(home)], integers: exact sums in any order
    across = jnp.where(node_link_class(topology), to_home, 0)
    return across.sum(0).astype(jnp.float32) * pair_xchg_s, across.sum(1).astype(jnp.float32) * pair_xchg_s


def home_node_share(crossing_nodes, home_node):
    """[..., N] the share of the home node's uncovered pairs among those of the nodes other than n,
    for each node n of a copy (0 on the home node itself: its copies draw from other nodes only).
    crossing_nodes [..., N] an expert's uncovered pairs from each node, home_node [...] or scalar.
    The pairs are whole numbers below 2^24, so their float32 sum is exact in any order."""
    nodes = jnp.arange(crossing_nodes.shape[-1])
    home_node = jnp.asarray(home_node)[..., None]
    at_home = jnp.take_along_axis(crossing_nodes, home_node, axis=-1)  # [..., 1]
    elsewhere = crossing_nodes.sum(-1, keepdims=True) - crossing_nodes
    share = jnp.where(elsewhere > 0, at_home / jnp.maximum(elsewhere, 1e-30), 0.0)
    return jnp.where(nodes == home_node, 0.0, jnp.minimum(share, 1.0))


def scale_out_shift(take, crossing_dest, home_share, same_node):
    """(pairs off the home's scale-out receive, pairs onto the destination's) when a copy takes
    `take` pairs of an expert, as locality-tiered routing feeds it: first the uncovered pairs of its
    own node (crossing_dest), which stop crossing to the home when that node is another; the rest
    from the other nodes' uncovered pairs in proportion, all crossing to the copy, and crossing to
    the home but for the home node's share (home_node_share). Broadcasts."""
    local = jnp.minimum(take, crossing_dest)
    rest = take - local
    return jnp.where(same_node, 0.0, local) + rest * (1.0 - home_share), rest


def exchange_saving(clock: TransferClock, home, dest, drop_s, rise_s):
    """Exchange seconds a copy saves: the fall of the largest scale-out exchange (receive, or the
    send floor) when `home`'s receive falls by drop_s and `dest`'s rises by rise_s. Broadcasts; dest
    None means every rank.

    Only a copy off the rank with the largest receive (the first of equals) saves anything, and at
    most down to the next largest receive or the send floor; it saves its drop, unless that lifts
    dest's receive above the home's new one."""
    recv = clock.exchange_recv
    ranks = jnp.arange(recv.shape[0])
    first = first_argmax(recv)
    largest = recv[first]
    next_largest = jnp.maximum(jnp.where(ranks == first, -jnp.inf, recv).max(), clock.exchange_floor)
    below = largest - recv  # [R] how far each rank's receive is below the largest
    below_dest = below if dest is None else below[dest]
    saving = jnp.clip(jnp.minimum(drop_s, below_dest - rise_s), 0.0, jnp.maximum(largest - next_largest, 0.0))
    return jnp.where(home == first, saving, 0.0)


def _exposed(busy, hide):
    """(forward, backward) exposed transfer seconds: weights out behind the home forward GEMMs,
    gradients back behind the backward (twice the forward)."""
    return jnp.maximum(busy - hide, 0.0), jnp.maximum(busy - 2.0 * hide, 0.0)


def copy_exposure(clock: TransferClock, home, dest, link, moved_fwd_s):
    """Extra layer seconds from the guest-weight term if `home` ships one expert to `dest` (link
    seconds, over NVLink or across nodes as their nodes say) and its home slots lose moved_fwd_s of
    forward GEMM. The cost model charges the most exposed rank, forward and backward, so a transfer
    costs only what it adds to those maxima. Broadcasts over candidate arrays; dest None prices a
    copy to every rank, [R]."""
    fwd_max, bwd_max = jnp.stack(_exposed(clock.busy, clock.hide)).max(1)
    at_home = clock.seconds[:, home]  # [6, ...] one gather
    at_dest = clock.seconds if dest is None else clock.seconds[:, dest]
    across = clock.node[home] != (clock.node if dest is None else clock.node[dest])
    nvlink, scale_out = jnp.where(across, 0.0, link), jnp.where(across, link, 0.0)
    home_busy = jnp.maximum(jnp.maximum(at_home[0] + nvlink, at_home[1] + scale_out),
                            jnp.maximum(at_home[2], at_home[3]))
    dest_busy = jnp.maximum(jnp.maximum(at_dest[0], at_dest[1]),
                            jnp.maximum(at_dest[2] + nvlink, at_dest[3] + scale_out))
    home_fwd, home_bwd = _exposed(home_busy, at_home[4] - moved_fwd_s)
    dest_fwd, dest_bwd = _exposed(dest_busy, at_dest[4])
    return (jnp.maximum(jnp.maximum(home_fwd, dest_fwd) - fwd_max, 0.0)
            + jnp.maximum(jnp.maximum(home_bwd, dest_bwd) - bwd_max, 0.0))


def clock_after_copy(clock: TransferClock, home, dest, link, moved_fwd_s, ok, drop_s, rise_s) -> TransferClock:
    """The clock after `home` ships one expert to `dest` (link seconds), where ok; the home's slots
    lose moved_fwd_s of forward GEMM, its scale-out receive drop_s, and dest's receive gains rise_s."""
    ranks = jnp.arange(clock.seconds.shape[1])[None, :]
    row = jnp.arange(6)[:, None]
    at_home = ok & (ranks == home)
    at_dest = ok & (ranks == dest)
    across = (clock.node[home] != clock.node[dest]).astype(jnp.int32)  # row 0/2 over NVLink, 1/3 across
    delta = (jnp.where((row == across) & at_home, link, 0.0) + jnp.where((row == 2 + across) & at_dest, link, 0.0)
             - jnp.where((row == 4) & at_home, moved_fwd_s, 0.0)
             - jnp.where((row == 5) & at_home, drop_s, 0.0) + jnp.where((row == 5) & at_dest, rise_s, 0.0))
    return clock._replace(seconds=clock.seconds + delta)
