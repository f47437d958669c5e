"""Pricing copies with the cost model: link classes, per-rank transfer clocks, exposed seconds.

Float32 seconds, computed in the same order on every device, from whole transfers and integer pair
counts (no float reduction whose order could vary).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jtopoep.costmodel import ExpertDims
from jtopoep.topology import Topology


def node_link_class(topology: Topology, xp=jnp):
    """[R, R] True where the two ranks are on different nodes."""
    node = xp.arange(topology.num_ranks) // topology.gpus_per_node
    return node[:, None] != node[None, :]


class TransferClock(NamedTuple):
    """Per-rank seconds of guest-weight transfer against the home-slot GEMM time that hides them.

    The cost model's rule: weights a rank sends (as home) or receives (as host) are free while they
    fit behind its home-slot forward GEMMs, and gradients going back behind its backward (twice the
    forward); only the rest is exposed. Planners use it to price a copy before making it. It prices
    whole copies: with the weights in slices (ExpertDims.weight_chunks) the cost model also hides a
    receiving rank's later slices behind its guest GEMMs of the earlier ones, so this is an upper
    bound on what a copy exposes (a rank that only sends gains nothing from slices).

    One [3, R] array (sent, received, hiding seconds) rather than three: a copy updates it with one
    kernel and reads a rank's column with one gather, in loops that make one copy per step."""
    seconds: jnp.ndarray  # [3, R] float32: weights sent, weights received, home-slot forward GEMM

    @classmethod
    def start(cls, hide):
        """Nothing sent or received yet; `hide` [R] seconds of home-slot forward GEMM."""
        return cls(jnp.stack([jnp.zeros_like(hide), jnp.zeros_like(hide), hide]))

    @property
    def send(self):
        return self.seconds[0]

    @property
    def recv(self):
        return self.seconds[1]

    @property
    def hide(self):
        return self.seconds[2]


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
    Broadcasts over candidate arrays; dest None prices a copy to every rank, [R]."""
    fwd_max, bwd_max = jnp.stack(_exposed(clock.send, clock.recv, clock.hide)).max(1)
    at_home = clock.seconds[:, home]  # [3, ...] one gather
    at_dest = clock.seconds if dest is None else clock.seconds[:, dest]
    home_fwd, home_bwd = _exposed(at_home[0] + link, at_home[1], at_home[2] - moved_fwd_s)
    dest_fwd, dest_bwd = _exposed(at_dest[0], at_dest[1] + link, at_dest[2])
    return (jnp.maximum(jnp.maximum(home_fwd, dest_fwd) - fwd_max, 0.0)
            + jnp.maximum(jnp.maximum(home_bwd, dest_bwd) - bwd_max, 0.0))


def clock_after_copy(clock: TransferClock, home, dest, link, moved_fwd_s, ok) -> TransferClock:
    """The clock after `home` ships one expert to `dest` (link seconds), where ok; the home's slots
    lose moved_fwd_s of forward GEMM."""
    ranks = jnp.arange(clock.seconds.shape[1])[None, :]
    row = jnp.arange(3)[:, None]
    at_home = ok & (ranks == home)
    at_dest = ok & (ranks == dest)
    delta = (jnp.where((row == 0) & at_home, link, 0.0) + jnp.where((row == 1) & at_dest, link, 0.0)
             - jnp.where((row == 2) & at_home, moved_fwd_s, 0.0))
    return TransferClock(clock.seconds + delta)
