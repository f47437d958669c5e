"""The grouped GEMM on Hopper GPUs: JAX's Mosaic GPU ragged-dot kernels, with their own backward.

XLA:GPU expands `jax.lax.ragged_dot` into one dense product per group over the whole receive
buffer, so its cost is (groups x buffer rows); these kernels tile the rows once, so the forward and
the input gradient cost (buffer rows) and the weight gradient (rows in the groups).
Forward and input gradient: `ragged_dot_mgpu.ragged_dot` (the second with the weights transposed in
the kernel); weight gradient: `transposed_ragged_dot_mgpu.transposed_ragged_dot`, which walks each
group's own row blocks. Both need bfloat16 or float16 operands of one dtype and feature sizes that
are multiples of 128 (the tiles); `check_hopper_shapes` says which.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jtopoep.varying import varying_like

TILE = 128  # rows and columns of an output tile
DEPTH = 64  # contraction step: 128 bytes of bfloat16, the widest TMA swizzle
STAGES = 4  # pipelined operand tiles in shared memory: 4 x 2 x 16 KiB + a 32 KiB output tile
DTYPES = (jnp.bfloat16, jnp.float16)


def check_hopper_shapes(x: jax.Array, weights: jax.Array) -> None:
    """One clear line when the operands do not fit the kernels' tiles."""
    if x.dtype != weights.dtype or x.dtype not in DTYPES:
        raise ValueError(f"moe.gemm=pallas on GPU needs bfloat16 or float16 activations and weights of one dtype; "
                         f"got {x.dtype} and {weights.dtype}")
    depth, width = weights.shape[1:]
    if depth % TILE or width % TILE:
        raise ValueError(f"moe.gemm=pallas on GPU needs d_model and expert_hidden (per guest-weight slice: "
                         f"expert_hidden / moe.guest_weight_chunks) multiples of {TILE}; got a [{depth}, {width}] "
                         f"expert matrix")


def _tail_in_last_group(group_sizes: jax.Array, rows: int) -> jax.Array:
    # The forward kernel covers every row of the buffer: rows past the groups ride in the last group
    # and are selected away afterwards.
    return group_sizes.at[-1].add(rows - group_sizes.sum())


def _rows_used(group_sizes: jax.Array, rows: int) -> jax.Array:
    return (jnp.arange(rows) < group_sizes.sum())[:, None]


def _ragged_dot(x, weights, group_sizes, transpose_rhs):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    out = ragged_dot_mgpu.ragged_dot(x, weights, group_sizes=_tail_in_last_group(group_sizes, x.shape[0]),
                                     block_m=TILE, block_n=TILE, block_k=DEPTH, max_concurrent_steps=STAGES,
                                     grid_block_n=1, transpose_rhs=transpose_rhs)
    return jnp.where(_rows_used(group_sizes, x.shape[0]), out, 0)


@jax.custom_vjp
def hopper_grouped_matmul(x: Float[Array, "M K"], weights: Float[Array, "G K N"],
                          group_sizes: Int[Array, " G"]) -> Float[Array, "M N"]:
    """x[rows of group g] @ weights[g] for each group in order; rows past the groups give zeros."""
    check_hopper_shapes(x, weights)
    return _ragged_dot(x, weights, group_sizes.astype(jnp.int32), transpose_rhs=False)


def _forward(x, weights, group_sizes):
    return hopper_grouped_matmul(x, weights, group_sizes), (x, weights, group_sizes.astype(jnp.int32))


def _weight_gradient(x, grad, group_sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, grad, group_sizes=group_sizes, block_m=TILE,
                                                            block_n=TILE, block_k=DEPTH,
                                                            max_concurrent_steps=STAGES, grid_block_n=1)


def _backward(residuals, grad):
    x, weights, group_sizes = residuals
    used = _rows_used(group_sizes, x.shape[0])
    grad = jnp.where(used, grad, 0).astype(x.dtype)
    grad_x = _ragged_dot(grad, weights, group_sizes, transpose_rhs=True)
    # The kernel masks neighbouring groups' rows by multiplying: rows past the groups must be finite.
    grad_w = _weight_gradient(jnp.where(used, x, 0), grad, group_sizes)
    return varying_like(grad_x, x), varying_like(grad_w.astype(weights.dtype), weights), None


hopper_grouped_matmul.defvjp(_forward, _backward)


@functools.cache
def hopper_available() -> bool:
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # noqa: F401
    except ImportError:
        return False
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"
