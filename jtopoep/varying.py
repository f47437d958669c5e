"""Which mesh axes a value varies over inside shard_map, and marking a value to vary like others.

Inside shard_map a loop's carry, and a custom backward's cotangent, must vary over the mesh axes its
inputs or its primal vary over; zeros made there, and a Pallas kernel's outputs, vary over none
until marked.
"""

from __future__ import annotations

import functools

import jax


def varying_axes(value: jax.Array) -> frozenset:
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)  # the manual-axis type since JAX 0.10; `vma` before
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like(value: jax.Array, *references: jax.Array) -> jax.Array:
    """value, marked to vary over every mesh axis any of `references` varies over."""
    wanted = functools.reduce(frozenset.union, (varying_axes(r) for r in references), frozenset())
    missing = tuple(sorted(wanted - varying_axes(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value
