"""Integer array utilities the planners share, written against an array namespace `xp` (jax.numpy
inside jit, numpy on the host) where a host planner uses them too, so both agree bit for bit.

Everything here is a fixed number of parallel passes: scatters, prefix sums, sorts and binary
searches, never a loop whose trip count grows with the ranks, the experts or the copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jtopoep.ordering import descending_key, key_range, stable_order


def ceil_div(a, b):
    return -(-a // b)


# Below this many element-steps a prefix sum runs as cumsums of blocks (a few kernels, each costing
# the elements times the block length); above it as an associative scan (log2(n) passes, each a few
# kernels). On XLA:CPU a small planner is a graph of many tiny kernels, and their count sets its time.
_BLOCKED_LIMIT = 1 << 18
# Up to this many element-steps a prefix sum is one cumsum: one kernel whose quadratic work is
# still less than the launches of the blocked form (a GPU runs the planners launch-bound).
_ONE_KERNEL_LIMIT = 1 << 17


def prefix_sum(x, axis: int = 0, xp=jnp):
    """Inclusive prefix sums along `axis`, the same integers on any backend. XLA:CPU lowers
    jnp.cumsum to a reduce-window whose cost grows with the square of the axis, so long axes are cut
    into blocks of about sqrt(n): cumsums within blocks, then over the block totals; large arrays take
    an associative scan."""
    if xp is np:
        return np.cumsum(x, axis=axis)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n <= 16 or x.size * n <= _ONE_KERNEL_LIMIT:
        return jnp.cumsum(x, axis=axis)
    block = 1 << ((n - 1).bit_length() + 1) // 2  # a power of two near sqrt(n)
    if x.size * block > _BLOCKED_LIMIT:
        return jax.lax.associative_scan(jnp.add, x, axis=axis)
    blocks = -(-n // block)
    moved = jnp.moveaxis(x, axis, -1)
    padded = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, blocks * block - n)])
    within = jnp.cumsum(padded.reshape(moved.shape[:-1] + (blocks, block)), axis=-1)
    offset = jnp.cumsum(within[..., -1], axis=-1) - within[..., -1]
    out = (within + offset[..., None]).reshape(moved.shape[:-1] + (blocks * block,))[..., :n]
    return jnp.moveaxis(out, -1, axis)


def exclusive_prefix_sum(x, axis: int = 0, xp=jnp):
    return prefix_sum(x, axis, xp) - x


def scatter_set(size: int, index, values, xp=jnp):
    """zeros(size) with values written at index; every index at most once, so order cannot matter."""
    if xp is np:
        out = np.zeros(size, values.dtype)
        out[index] = values
        return out
    return jnp.zeros(size, values.dtype).at[index].set(values, unique_indices=True)


def scatter_add(shape, index: tuple, values, xp=jnp):
    """zeros(shape) with values added at index; integer, so the result does not depend on order."""
    if xp is np:
        out = np.zeros(shape, values.dtype)
        np.add.at(out, index, values)
        return out
    return jnp.zeros(shape, values.dtype).at[index].add(values)


def proportional_floor(share, x, whole, xp=jnp):
    """floor(share * x / whole) elementwise and exact, for int32 0 <= share, x <= whole (0 where
    whole is 0): the part of `share` that falls on the first x of `whole`, monotone in x and rising
    by at most one per unit of x. The product can pass 2^31, so inside jit it is formed one bit of x
    at a time in uint32, its remainder kept below `whole` (a fixed 31 elementwise steps, one fusion)."""
    if xp is np:
        whole = np.asarray(whole, np.int64)
        return np.where(whole > 0, np.asarray(share, np.int64) * x // np.maximum(whole, 1), 0).astype(np.int32)
    share, x = share.astype(jnp.uint32), x.astype(jnp.uint32)
    divisor = jnp.maximum(whole, 1).astype(jnp.uint32)
    quotient = jnp.zeros_like(x)
    remainder = jnp.zeros_like(x)  # share * (x's bits so far) = quotient * divisor + remainder
    for bit in range(30, -1, -1):
        quotient, remainder = quotient * 2, remainder * 2  # remainder < 2 divisor < 2^32
        over = remainder >= divisor
        quotient, remainder = quotient + over, jnp.where(over, remainder - divisor, remainder)
        remainder = remainder + jnp.where((x >> bit) & 1 == 1, share, 0)  # < divisor + share <= 2 divisor
        over = remainder >= divisor
        quotient, remainder = quotient + over, jnp.where(over, remainder - divisor, remainder)
    return jnp.where(whole > 0, quotient, 0).astype(jnp.int32)


def one_hot(ids, n, xp=jnp):
    """int32 one-hot of ids along a new last axis; id -1 gives an all-zero row."""
    return (ids[..., None] == xp.arange(n, dtype=xp.int32)).astype(xp.int32)


def overlap(lo_a, hi_a, lo_b, hi_b, xp=jnp):
    """Length of the overlap of the intervals [lo_a, hi_a) and [lo_b, hi_b); broadcasts."""
    return xp.maximum(xp.minimum(hi_a, hi_b) - xp.maximum(lo_a, lo_b), 0)


def holds_home(home_rank, num_ranks: int, xp=jnp):
    """[R, n] True where the rank is the home of each of n experts, given their home ranks [n]."""
    return home_rank[None, :] == xp.arange(num_ranks, dtype=xp.int32)[:, None]


def order_by(segment: Int[Array, " n"], num_segments: int, largest_first: Int[Array, " n"] | None = None
             ) -> Int[Array, " n"]:
    """The permutation that sorts n entries by segment (ids in [0, num_segments)), then by
    largest_first descending (non-negative; values of key_range(n) and above tie), ties to the lower
    index: the same on every device. Two single-key sorts of packed int32 keys
    (ordering.stable_order), which XLA:CPU runs far faster than one sort with several keys."""
    n = segment.shape[0]
    order = jnp.arange(n, dtype=jnp.int32)
    if largest_first is not None:
        bound = key_range(n)
        order = stable_order(descending_key(largest_first, bound), bound)
    if num_segments == 1:
        return order
    return order[stable_order(segment[order], num_segments)]


# Up to this many entries, which entries come before which in an order_by order is one [n, n]
# comparison that fuses into each use (earlier_in_segment), instead of the sorts, scatters and gathers
# that carry the order (several kernels each, on a GPU each a launch): 64k compares cost less than
# the launches they replace, while n^2 work past it would not.
PAIRWISE_LIMIT = 256
# Platforms that keep the sorts at every size: XLA:CPU's reductions over an [n, n] comparison take
# longer than its few small kernels for the sorts and scatters.
SORTED_ORDER_PLATFORMS: tuple[str, ...] = ("cpu",)


def pairwise_or_sorted(num: int, pairwise, in_sorted_order):
    """pairwise() for num entries up to PAIRWISE_LIMIT, except on SORTED_ORDER_PLATFORMS; else
    in_sorted_order(): two forms of one result, chosen when the program is compiled."""
    if num > PAIRWISE_LIMIT:
        return in_sorted_order()
    return jax.lax.platform_dependent(default=pairwise, **{p: in_sorted_order for p in SORTED_ORDER_PLATFORMS})


def earlier_in_segment(segment: Int[Array, " n"], largest_first: Int[Array, " n"] | None = None
                       ) -> Bool[Array, "n n"]:
    """[p, q]: whether entry q shares entry p's segment and comes before it in order_by(segment, _,
    largest_first)'s order (largest_first descending as order_by keys it, ties to the lower index)."""
    n = segment.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    ahead = index[None, :] < index[:, None]
    if largest_first is not None:
        key = descending_key(largest_first, key_range(n))
        ahead = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & ahead)
    return (segment[None, :] == segment[:, None]) & ahead


def segmented_prefix_sum(x: Int[Array, "n *c"], segment: Int[Array, " n"], num_segments: int) -> Int[Array, "n *c"]:
    """Inclusive prefix sums along axis 0 of x >= 0 that restart at each run of sorted segment ids
    (in [0, num_segments)): the prefix less its value where the segment starts, the least of the
    segment's (non-decreasing) exclusive prefixes, found by one scatter-min."""
    total = prefix_sum(x)
    start = jnp.full((num_segments,) + x.shape[1:], jnp.iinfo(jnp.int32).max, jnp.int32).at[segment].min(total - x)
    return total - start[segment]

def carry_like(state, ref):
    """The loop state with the same device-variance as `ref`: inside shard_map, counts all-gathered
    over the mesh are typed as varying over its axes, and a loop carry must keep one type, so
    constants in the initial state are made to vary the same way by adding a zero derived from ref."""
    zero = ref.reshape(-1)[:1].sum() * 0
    return jax.tree.map(lambda x: x | (zero != 0) if x.dtype == bool else x + zero.astype(x.dtype), state)
