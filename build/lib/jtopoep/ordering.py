"""Deterministic orders that XLA:CPU computes cheaply: stable sorts through one single-operand sort,
and first-index argmax / argmin through two plain reductions.

XLA:CPU sorts a lone int32 array far faster than it sorts keys with a payload: `jnp.argsort` carries
an index through a generic comparator, where sorting the int32 values alone is a plain numeric
sort. Packing key * n + index
into one int32 gives the same stable order whenever it fits in 31 bits, which the shapes decide
statically; when it does not, these fall back to argsort.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_INT32_LIMIT = 2**31


def stable_order(keys, num_keys: int, xp=jnp):
    """The permutation that sorts `keys` (integers in [0, num_keys)) ascending along the last axis,
    ties to the lower index: argsort(keys, stable=True)."""
    n = keys.shape[-1]
    if xp is np or num_keys * n > _INT32_LIMIT:
        return xp.argsort(keys, axis=-1, stable=True).astype(xp.int32)
    packed = keys.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)
    return jnp.sort(packed, axis=-1) % n


def descending_key(values, num_keys: int, xp=jnp):
    """Keys in [0, num_keys) that order non-negative `values` largest first; values of num_keys - 1
    and above share the first key (then order by index). For ordering counts, where that bound
    (2**31 / n) is far above any count of pairs."""
    return (num_keys - 1 - xp.minimum(values, num_keys - 1)).astype(xp.int32)


def key_range(n: int) -> int:
    """The most distinct keys stable_order packs for rows of n without falling back."""
    return _INT32_LIMIT // n


def inverse_permutation(order):
    """inverse[order[i]] = i: a scatter of n values, where argsort(order) would sort them."""
    n = order.shape[0]
    return jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


def first_argmax(x, axis=None, xp=jnp):
    """The index of the first maximum along `axis` (flattened when None): jnp.argmax for inputs
    without NaN. XLA:CPU lowers argmax to a reduction carrying (value, index) pairs that it does not
    vectorise; the maximum, then the least index holding it, are two plain reductions that it does,
    and give the same index. Each reduction reads x,
    so where x is an expensive expression XLA would fuse into both, materialise it first behind
    jax.lax.optimization_barrier (taot's move score does)."""
    if xp is np:
        return np.argmax(x, axis=axis)
    return _first_index_of(x, x.max(axis=axis, keepdims=True), axis)


def first_argmin(x, axis=None, xp=jnp):
    """The index of the first minimum along `axis` (flattened when None): jnp.argmin without NaN."""
    if xp is np:
        return np.argmin(x, axis=axis)
    return _first_index_of(x, x.min(axis=axis, keepdims=True), axis)


def _first_index_of(x, value, axis):
    if axis is None:
        x, value, axis = x.reshape(-1), value.reshape(-1), 0
    axis = axis % x.ndim
    n = x.shape[axis]
    index = jnp.arange(n, dtype=jnp.int32).reshape((n,) + (1,) * (x.ndim - 1 - axis))
    return jnp.where(x == value, index, n).min(axis=axis)
