"""The grouped GEMM in plain XLA operations, tiled over the rows (moe.gemm=tiled), for any backend.

XLA expands `jax.lax.ragged_dot` into one dense product per group over the whole buffer, so its
time and its temporaries grow with groups x buffer rows. Here one loop of static trip count walks
work items: a tile of rows and one group that has rows in it. Rows come in group order, so each
group meets a run of consecutive tiles and there are at most tiles + groups - 1 items; the products
cost (rows + (groups - 1) x tile) x K x N and the temporaries are a tile's, whatever the groups.
A row belongs to exactly one item (its group's, in its tile), so the forward pass and the input
gradient select each row's product once, as ragged_dot does. The weight gradient sums a group's
tiles in float32 and rounds once, as one product over the group's rows would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jtopoep.buffers import zeros_after
from jtopoep.varying import varying_like

# Rows per tile. Each step also copies its slot's [K, N] weights out of the stack (XLA:GPU does not
# fuse the dynamic slice into the product), which costs a GPU about 250 / tile of the product's
# time, while the boundary tiles add up to (groups - 1) tiles of work: 1,024 rows keeps both small
# for buffers of tens of thousands of rows.
ROW_TILE = 1024
# The weight gradient's tile is larger: each item adds a [K, N] float32 partial sum into the
# group's running sum, whose traffic a tile of 2,048 rows amortises over the product.
WEIGHT_GRADIENT_TILE = 2048


class WorkItems:
    """Which group and which tile of rows each loop step computes, and the rows it owns."""

    def __init__(self, group_sizes: Int[Array, " G"], rows: int, tile: int, first_row: Int[Array, ""] | int = 0):
        groups = group_sizes.shape[0]
        if rows < 1 or groups < 1:
            raise ValueError(f"the tiled grouped GEMM needs at least one row and one group; got {rows} rows and "
                             f"{groups} groups")
        self.tile = min(tile, rows)
        tiles = -(-rows // self.tile)
        self.count = tiles + groups - 1  # every group boundary inside a tile adds at most one item
        ends = first_row + jnp.cumsum(group_sizes)
        starts = ends - group_sizes
        first = starts // self.tile
        met = jnp.where(group_sizes > 0, (ends - 1) // self.tile - first + 1, 0)
        item_end = jnp.cumsum(met)
        step = jnp.arange(self.count)
        group = jnp.minimum(jnp.searchsorted(item_end, step, side="right"), groups - 1)
        tile_index = first[group] + step - (item_end[group] - met[group])
        valid = step < item_end[-1]
        # The rows an item owns: its group's, within its tile; none for the steps past the last item.
        self.group = group.astype(jnp.int32)
        self.own_start = jnp.where(valid, jnp.maximum(starts[group], tile_index * self.tile), 0)
        self.own_end = jnp.where(valid, jnp.minimum(ends[group], (tile_index + 1) * self.tile), 0)
        # The last tile is slid back to end at the buffer's end; the ownership bounds keep its
        # overlap with the tile before it counted once.
        self.first_row = jnp.minimum(tile_index * self.tile, rows - self.tile)
        self.new_group = jnp.concatenate([jnp.ones(1, bool), self.group[1:] != self.group[:-1]])

    def at(self, step) -> tuple[Int[Array, ""], Int[Array, ""], Bool[Array, "W 1"]]:
        """Group, first row of the tile, and which of the tile's rows the step owns."""
        first_row = self.first_row[step]
        row = first_row + jnp.arange(self.tile)
        owned = (row >= self.own_start[step]) & (row < self.own_end[step])
        return self.group[step], first_row, owned[:, None]

    def add_to_slot_sum(self, step, part, running, sums):
        """(running, sums) after adding item `step`'s float32 `part` to its slot's running sum (restarted
        at the slot's first item) and writing that sum, cast to sums' dtype, into the slot's entry of
        `sums`: written at every item of the slot, so the last one leaves the slot's whole sum,
        rounded once."""
        running = jnp.where(self.new_group[step], part, running + part)
        return running, jax.lax.dynamic_update_index_in_dim(sums, running.astype(sums.dtype), self.group[step], 0)


def _rows_product(a, weights, group_sizes, first_row, contract_weight_axis: int):
    """a[rows of group g] @ weights[g] (contract_weight_axis 1) or @ weights[g].T (axis 2)."""
    rows = a.shape[0]
    items = WorkItems(group_sizes, rows, ROW_TILE, first_row)
    width = weights.shape[3 - contract_weight_axis]

    def step(i, out):
        group, first_row, owned = items.at(i)
        tile = jax.lax.dynamic_slice_in_dim(a, first_row, items.tile)
        weight = jax.lax.dynamic_index_in_dim(weights, group, keepdims=False)
        product = jax.lax.dot_general(tile, weight, (((1,), (contract_weight_axis - 1,)), ((), ())),
                                      preferred_element_type=jnp.float32).astype(out.dtype)
        before = jax.lax.dynamic_slice_in_dim(out, first_row, items.tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(owned, product, before), first_row, 0)

    out = varying_like(zeros_after(a, (rows, width), a.dtype), a, weights)
    return jax.lax.fori_loop(0, items.count, step, out)


def _weight_gradient(x, grad, group_sizes, first_row, weights_dtype):
    groups = group_sizes.shape[0]
    items = WorkItems(group_sizes, x.shape[0], WEIGHT_GRADIENT_TILE, first_row)

    def step(i, carry):
        running, gradient = carry
        _, first_row, owned = items.at(i)
        tile_x = jnp.where(owned, jax.lax.dynamic_slice_in_dim(x, first_row, items.tile), 0)
        tile_grad = jnp.where(owned, jax.lax.dynamic_slice_in_dim(grad, first_row, items.tile), 0)
        part = jax.lax.dot_general(tile_x, tile_grad, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return items.add_to_slot_sum(i, part, running, gradient)

    shape = (x.shape[1], grad.shape[1])
    running = varying_like(zeros_after(grad, shape, jnp.float32), x, grad)
    gradient = varying_like(zeros_after(grad, (groups, *shape), weights_dtype), x, grad)
    return jax.lax.fori_loop(0, items.count, step, (running, gradient))[1]


@jax.custom_vjp
def tiled_grouped_matmul(x: Float[Array, "M K"], weights: Float[Array, "G K N"], group_sizes: Int[Array, " G"],
                         first_row: Int[Array, ""] | int = 0) -> Float[Array, "M N"]:
    """x[rows of group g] @ weights[g] for each group in order, the groups' rows starting at
    first_row; the other rows give zeros."""
    return _forward(x, weights, group_sizes, first_row)[0]


def _forward(x, weights, group_sizes, first_row=0):
    x, weights = jnp.asarray(x), jnp.asarray(weights)
    group_sizes, first_row = jnp.asarray(group_sizes, jnp.int32), jnp.asarray(first_row, jnp.int32)
    out = _rows_product(x, weights, group_sizes, first_row, contract_weight_axis=1)
    return out, (x, weights, group_sizes, first_row)


def _backward(residuals, grad):
    x, weights, group_sizes, first_row = residuals
    grad = grad.astype(x.dtype)
    grad_x = _rows_product(grad, weights, group_sizes, first_row, contract_weight_axis=2)
    grad_w = _weight_gradient(x, grad, group_sizes, first_row, weights.dtype)
    return varying_like(grad_x, x), varying_like(grad_w, weights), None, None


tiled_grouped_matmul.defvjp(_forward, _backward)
