"""The experts' SwiGLU over the slot-ordered receive buffer in one tiled pass (moe.gemm=tiled).

Three grouped GEMMs per weight set (gate, up, down), as jtopoep.dispatch composed them, each give a
buffer-sized output: gate and up [rows, F], the output [rows, D], and in the backward an input
gradient [rows, D] per GEMM, summed afterwards. With guest slots the guest GEMMs give their own, so
a layer with copies held several more [rows, D] buffers than one without (XLA's memory analysis:
benchmarks.memory). Here one loop over work items (gemm_tiled.WorkItems: a tile of rows and the slot
that owns some of them) computes a tile's whole SwiGLU, and every loop writes into one output buffer
and, backward, one input-gradient buffer: the home slots' loop first, then one loop per guest slice
(guests.hidden_slice), which adds its part to the guest rows. So the buffers are the output, the
gate and up values saved for the backward ([rows, 2F] for home and guest rows together), and the
input gradient, whatever the slots and slices.

Each guest slice's loop waits only for that slice's weights (the transfer overlaps the home loop),
and backward the guest loops run first, so the guest gradients can travel home during the home
loop. Values are rounded as the separate GEMMs round them (float32 products, cast to the buffer's
dtype); the input gradient of a tile sums its gate and up products in float32 before rounding once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jtopoep import gemm_tiled
from jtopoep.buffers import zeros_after
from jtopoep.guests import ExpertWeights
from jtopoep.varying import varying_like


def _dot(a, b, contract: tuple[int, int]):
    return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=jnp.float32)


def _activation(gate, up):
    return jax.nn.silu(gate) * up


def _forward_loop(x, weights: ExpertWeights, sizes, first_row, out, saved, column: int, accumulate: bool):
    """out and saved after one loop over the slots `sizes` (their rows from first_row): each owned
    row's SwiGLU written (or, accumulate, added) into out, its gate and up into saved (the whole
    hidden width's gate, then its up), from `column` of each half: these weights' slice of it."""
    rows = x.shape[0]
    items = gemm_tiled.WorkItems(sizes, rows, gemm_tiled.ROW_TILE, first_row)
    width = weights.gate.shape[2]
    half = saved.shape[1] // 2

    def step(i, carry):
        out, saved = carry
        group, start, owned = items.at(i)
        tile = jax.lax.dynamic_slice_in_dim(x, start, items.tile)
        w = [jax.lax.dynamic_index_in_dim(m, group, keepdims=False) for m in weights]
        gate = _dot(tile, w[0], (1, 0)).astype(x.dtype)
        up = _dot(tile, w[1], (1, 0)).astype(x.dtype)
        y = _dot(_activation(gate, up), w[2], (1, 0)).astype(out.dtype)
        before = jax.lax.dynamic_slice_in_dim(out, start, items.tile)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(owned, before + y if accumulate else y, before),
                                                  start, 0)
        for offset, value in ((column, gate), (half + column, up)):
            kept = jax.lax.dynamic_slice(saved, (start, offset), (items.tile, width))
            saved = jax.lax.dynamic_update_slice(saved, jnp.where(owned, value, kept), (start, offset))
        return out, saved

    return jax.lax.fori_loop(0, items.count, step, (out, saved))


def _backward_loop(x, weights: ExpertWeights, sizes, first_row, saved, grad, grad_x, column: int):
    """(grad_x with the slots' input gradient added, the slots' weight gradients): one loop over the
    slots' work items, each slot's weight gradients summed over its tiles in float32, rounded once."""
    rows = x.shape[0]
    items = gemm_tiled.WorkItems(sizes, rows, gemm_tiled.WEIGHT_GRADIENT_TILE, first_row)
    width = weights.gate.shape[2]
    half = saved.shape[1] // 2
    depth = x.shape[1]

    def step(i, carry):
        grad_x, running, grads = carry
        group, start, owned = items.at(i)
        tile_x = jnp.where(owned, jax.lax.dynamic_slice_in_dim(x, start, items.tile), 0)
        tile_grad = jnp.where(owned, jax.lax.dynamic_slice_in_dim(grad, start, items.tile), 0)
        gate = jax.lax.dynamic_slice(saved, (start, column), (items.tile, width))
        up = jax.lax.dynamic_slice(saved, (start, half + column), (items.tile, width))
        w = [jax.lax.dynamic_index_in_dim(m, group, keepdims=False) for m in weights]
        activated, activation_vjp = jax.vjp(_activation, gate, up)
        grad_activated = _dot(tile_grad, w[2], (1, 1)).astype(x.dtype)
        grad_gate, grad_up = activation_vjp(grad_activated)
        grad_gate, grad_up = jnp.where(owned, grad_gate, 0), jnp.where(owned, grad_up, 0)
        tile_grad_x = (_dot(grad_gate, w[0], (1, 1)) + _dot(grad_up, w[1], (1, 1))).astype(grad_x.dtype)
        before = jax.lax.dynamic_slice_in_dim(grad_x, start, items.tile)
        grad_x = jax.lax.dynamic_update_slice_in_dim(grad_x, jnp.where(owned, before + tile_grad_x, before), start, 0)
        parts = (_dot(tile_x, grad_gate, (0, 0)), _dot(tile_x, grad_up, (0, 0)),
                 _dot(jnp.where(owned, activated, 0), tile_grad, (0, 0)))
        running, grads = zip(*(items.add_to_slot_sum(i, p, r, g) for p, r, g in zip(parts, running, grads)))
        return grad_x, running, grads

    shapes = ((depth, width), (depth, width), (width, grad.shape[1]))
    running = tuple(varying_like(zeros_after(grad, s, jnp.float32), x, grad, saved) for s in shapes)
    grads = tuple(varying_like(zeros_after(grad, m.shape, m.dtype), x, grad, m) for m in weights)
    grad_x, _, grads = jax.lax.fori_loop(0, items.count, step, (grad_x, running, grads))
    return grad_x, ExpertWeights(*(varying_like(g, m) for g, m in zip(grads, weights)))


def _columns(home: ExpertWeights, guest_slices) -> tuple[int, list[int]]:
    """The hidden width F and each guest slice's first column of it."""
    hidden = home.gate.shape[2]
    starts, start = [], 0
    for part in guest_slices:
        starts.append(start)
        start += part.gate.shape[2]
    if guest_slices and start != hidden:
        raise ValueError(f"the guest slices' hidden widths add up to {start}; the home experts' is {hidden}")
    return hidden, starts


@jax.custom_vjp
def tiled_swiglu(x: Float[Array, "rows D"], home: ExpertWeights, guest_slices: tuple[ExpertWeights, ...],
                 group_sizes: Int[Array, " S"]) -> Float[Array, "rows D"]:
    """SwiGLU of each row with its slot's expert, rows in slot order (the H home slots, then the K
    guest slots, group_sizes[j] rows for slot j); rows past the groups give zeros. guest_slices:
    the guest slots' weights as slices of the hidden width, summed (SwiGLU sums over hidden units);
    () without guest slots."""
    return _tiled_swiglu_forward(x, home, guest_slices, group_sizes)[0]


def _tiled_swiglu_forward(x, home, guest_slices, group_sizes):
    x, home = jnp.asarray(x), ExpertWeights(*map(jnp.asarray, home))
    guest_slices = tuple(ExpertWeights(*map(jnp.asarray, part)) for part in guest_slices)
    rows, depth = x.shape
    num_home = home.gate.shape[0]
    hidden, starts = _columns(home, guest_slices)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    out = varying_like(zeros_after(x, (rows, depth), x.dtype), x, *home)
    saved = varying_like(zeros_after(x, (rows, 2 * hidden), x.dtype), x, *home)
    # Scopes named as the composed GEMMs' (benchmarks.gpu_check finds the loops by them).
    with jax.named_scope("home_ffn"):
        out, saved = _forward_loop(x, home, group_sizes[:num_home], 0, out, saved, 0, accumulate=False)
    guest_first = group_sizes[:num_home].sum()
    for c, (part, column) in enumerate(zip(guest_slices, starts)):
        with jax.named_scope("guest_ffn"), jax.named_scope(f"slice{c}"):
            out, saved = (varying_like(a, *part) for a in (out, saved))
            out, saved = _forward_loop(x, part, group_sizes[num_home:], guest_first, out, saved, column,
                                       accumulate=True)
    return out, (x, home, guest_slices, group_sizes, saved)


def _tiled_swiglu_backward(residuals, grad):
    x, home, guest_slices, group_sizes, saved = residuals
    num_home = home.gate.shape[0]
    _, starts = _columns(home, guest_slices)
    grad = grad.astype(x.dtype)
    grad_x = varying_like(zeros_after(grad, x.shape, x.dtype), x, grad, *home,
                          *(m for part in guest_slices for m in part))
    guest_first = group_sizes[:num_home].sum()
    guest_grads = []
    for part, column in zip(guest_slices, starts):  # first, so their gradients can leave during the home loop
        grad_x, part_grads = _backward_loop(x, part, group_sizes[num_home:], guest_first, saved, grad, grad_x, column)
        guest_grads.append(part_grads)
    grad_x, home_grads = _backward_loop(x, home, group_sizes[:num_home], 0, saved, grad, grad_x, 0)
    return varying_like(grad_x, x), home_grads, tuple(guest_grads), None


tiled_swiglu.defvjp(_tiled_swiglu_forward, _tiled_swiglu_backward)

__all__ = ["tiled_swiglu"]
