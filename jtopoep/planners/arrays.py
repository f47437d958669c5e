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


def prefix_sum(x, axis: int = 0, xp=jnp):
    """Inclusive prefix sums along `axis`. XLA:CPU lowers jnp.cumsum to a reduce-window whose cost
    grows with the square of the axis; an associative scan does log2(n) passes instead and gives
    the same integers on any backend."""
    if xp is np:
        return np.cumsum(x, axis=axis)
    return jax.lax.associative_scan(jnp.add, x, axis=axis)


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
    return order[stable_order(segment[order], num_segments)]


def segment_starts(segment: Int[Array, " n"]) -> Bool[Array, " n"]:
    """True at the first entry of each run of equal, sorted segment ids."""
    return jnp.concatenate([jnp.ones(1, bool), segment[1:] != segment[:-1]])


def segmented_prefix_sum(x: Int[Array, " n"], starts: Bool[Array, " n"]) -> Int[Array, " n"]:
    """Inclusive prefix sums of x that restart where `starts` is True."""
    total = prefix_sum(x)
    first = jax.lax.associative_scan(jnp.maximum, jnp.where(starts, jnp.arange(x.shape[0]), 0))
    return total - (total - x)[first]


def carry_like(state, ref):
    """The loop state with the same device-variance as `ref`: inside shard_map, counts all-gathered
    over the mesh are typed as varying over its axes, and a loop carry must keep one type, so
    constants in the initial state are made to vary the same way by adding a zero derived from ref."""
    zero = ref.reshape(-1)[:1].sum() * 0
    return jax.tree.map(lambda x: x | (zero != 0) if x.dtype == bool else x + zero.astype(x.dtype), state)
