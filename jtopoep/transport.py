"""Token and weight exchange between expert-parallel ranks: ragged all-to-all and its exact emulation.

Back ends (one signature):
- "ragged": `jax.lax.ragged_all_to_all`, exact sizes, no padding (GPU and TPU; XLA:CPU cannot run it).
- "dense": an exact emulation on any backend: each rank pads what it sends to every peer to a fixed
  `capacity` rows, swaps the blocks with `jax.lax.all_to_all`, and scatters the received rows to the
  offsets the senders named. With capacity >= the largest send, nothing is ever dropped; it costs
  peers x capacity rows of send and receive buffer per rank (for token dispatch with capacity = T*k:
  R x T*k x D elements, R times the ragged buffers).
- "auto": "ragged" on GPU/TPU, "dense" elsewhere.

`exchange` moves rows between the ranks of the ("node", "gpu") mesh given the global matrix
sizes[s, d] (rows from source rank s to destination rank d), which every rank knows because it is
derived from the all-gathered plan. `_stage` is the same exchange among the peers of one mesh axis,
which the deduplicated two-stage token dispatch (jtopoep.relay) is built from.

Every exchange's backward pass is the reverse exchange (_into_zeros), its zeroed receive buffer made
where it is used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from jtopoep.buffers import zeros_after

BACKENDS = ("auto", "ragged", "dense")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown transport {backend!r}; known transports: {list(BACKENDS)}")
    if backend == "auto":
        return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "dense"
    return backend


def exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_dense(operand: Shaped[Array, "rows *feat"], output: Shaped[Array, "out *feat"],
                            input_offsets: Int[Array, " P"], send_sizes: Int[Array, " P"],
                            output_offsets: Int[Array, " P"], recv_sizes: Int[Array, " P"], *,
                            axis_name, capacity: int) -> Shaped[Array, "out *feat"]:
    """Exact emulation of `jax.lax.ragged_all_to_all` with a padded `all_to_all`.

    Same arguments and result as the collective: this rank sends
    operand[input_offsets[p] : input_offsets[p] + send_sizes[p]] to peer p, where it lands at
    output[output_offsets[p] : ...] of p's output; from peer p this rank receives recv_sizes[p] rows.
    Rows of `output` that nothing is written to keep their values.

    Two peers, capacity 3, feature width 1:
        rank 0: operand [a b c], input_offsets [0 1], send_sizes [1 2], output_offsets [0 0]
        rank 1: operand [d e f], input_offsets [0 2], send_sizes [2 1], output_offsets [1 1]
        padded blocks  rank 0: [[a . .], [b c .]]   rank 1: [[d e .], [f . .]]
        after all_to_all  rank 0: [[a . .], [d e .]]   rank 1: [[b c .], [f . .]]
        rank 0 output [a d e], rank 1 output [b c f]
    """
    peers = send_sizes.shape[0]
    rows = jnp.arange(capacity, dtype=jnp.int32)
    take = input_offsets[:, None] + rows[None, :]  # [P, C]
    sending = rows[None, :] < send_sizes[:, None]
    blocks = operand[jnp.clip(take, 0, operand.shape[0] - 1)]
    blocks = jnp.where(sending.reshape(sending.shape + (1,) * (operand.ndim - 1)), blocks, 0)
    received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=False)  # [P, C, ...] by source
    # Where each source asked its rows to land in this rank's output.
    landing = jax.lax.all_to_all(output_offsets.reshape(peers, 1), axis_name, 0, 0, tiled=False)[:, 0]
    position = landing[:, None] + rows[None, :]
    # Padding rows go past the end, where the scatter drops them, each to its own index: a row lands
    # at most once, so the scatter's indices are unique (XLA need not serialise it). Senders' rows land
    # below (P + 1) * C.
    past_end = max(output.shape[0], (peers + 1) * capacity) + jnp.arange(peers * capacity).reshape(peers, capacity)
    position = jnp.where(rows[None, :] < recv_sizes[:, None], position, past_end)
    return output.at[position.reshape(-1)].set(received.reshape((-1,) + operand.shape[1:]), mode="drop",
                                               unique_indices=True)


def _all_to_all(backend: str, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                axis_name, capacity):
    if backend == "ragged":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name=axis_name)
    return ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis_name, capacity=capacity)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 9, 10))
def _into_zeros(backend: str, operand, input_offsets, send_sizes, output_offsets, recv_sizes, back_input_offsets,
                back_output_offsets, out_rows: int, axis_name, capacity: int):
    """_all_to_all into a zeroed [out_rows, ...] output made here, whose backward is the reverse
    exchange into a zeroed operand-shaped buffer made there. JAX's own transpose zeroes that buffer
    with a broadcast XLA merges with every other exchange's into one early fusion (so the backward
    buffers of every exchange of the layer are live at once), carries the cotangent of the output
    operand, which is zeros here, through two more operand-sized buffers, and all-to-alls the offsets
    that the callers here know already. back_input_offsets [P]: where the rows from each peer landed
    in this rank's output; back_output_offsets [P]: where each peer took the rows it sent this rank."""
    output = zeros_after(operand, (out_rows,) + operand.shape[1:], operand.dtype)
    return _all_to_all(backend, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name,
                       capacity)


def _into_zeros_forward(backend, operand, input_offsets, send_sizes, output_offsets, recv_sizes, back_input_offsets,
                        back_output_offsets, out_rows, axis_name, capacity):
    out = _into_zeros(backend, operand, input_offsets, send_sizes, output_offsets, recv_sizes, back_input_offsets,
                      back_output_offsets, out_rows, axis_name, capacity)
    shape = jnp.zeros((operand.shape[0], 0), operand.dtype)  # the operand's rows and type, no bytes
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes, back_input_offsets, back_output_offsets, shape)


def _into_zeros_backward(backend, out_rows, axis_name, capacity, residuals, cotangent):
    input_offsets, send_sizes, output_offsets, recv_sizes, back_input_offsets, back_output_offsets, shape = residuals
    if not jnp.issubdtype(shape.dtype, jnp.inexact):  # integer rows carry no gradient
        return (None,) * 7
    grad = _into_zeros(backend, cotangent.astype(shape.dtype), back_input_offsets, recv_sizes, back_output_offsets,
                       send_sizes, input_offsets, output_offsets, shape.shape[0], axis_name, capacity)
    return (grad,) + (None,) * 6


_into_zeros.defvjp(_into_zeros_forward, _into_zeros_backward)


def _stage(x, sizes: Int[Array, "P P"], me, axis_name, out_rows: int, backend: str, capacity: int):
    """One ragged exchange among the P peers of `axis_name` (me: this rank's index among them).

    x holds the rows for peer p contiguously, in peer order; the result holds the rows from each peer
    in peer order, then zeros."""
    send = sizes[me]
    recv = sizes[:, me]
    landing = exclusive_cumsum(sizes, axis=0)  # [s, d]: where s's rows land on d
    taking = exclusive_cumsum(sizes, axis=1)  # [s, d]: where s takes its rows for d
    return _into_zeros(backend, x, taking[me], send, landing[me], recv, landing[:, me], taking[:, me], out_rows,
                       axis_name, capacity)


def exchange_rows(x: Shaped[Array, "rows *feat"], send: Int[Array, " R"], recv: Int[Array, " R"], *, out_rows: int,
                  gpus_per_node: int, backend: str = "auto", capacity: int | None = None,
                  axes: tuple[str, str] = ("node", "gpu")) -> Shaped[Array, "out *feat"]:
    """`exchange` from this rank's own sizes only: send[d] rows to each destination d, recv[s] rows
    from each source s (so no rank needs the [R, R] whole). Where its rows land on each destination
    comes from that destination, and where each source took the rows it sends here (for the backward
    pass) from that source: one all-to-all of R pairs of offsets."""
    backend = resolve_backend(backend)
    capacity = x.shape[0] if capacity is None else capacity
    taking, landed = exclusive_cumsum(send), exclusive_cumsum(recv)  # here: rows for each peer, from each
    peers = jax.lax.all_to_all(jnp.stack([landed, taking], 1), axes, 0, 0, tiled=True)  # [R, 2], from each peer
    landing, taken_at = peers[:, 0], peers[:, 1]
    return _into_zeros(backend, x, taking, send, landing, recv, landed, taken_at, out_rows, axes, capacity)


@jax.custom_vjp
def regroup(x: Shaped[Array, "rows *feat"], sizes: Int[Array, "P Q"]) -> Shaped[Array, "rows *feat"]:
    """Reorder segments laid out in (p, q) order, segment (p, q) holding sizes[p, q] rows, into (q, p)
    order. Rows past the segments come out as zeros. A gather, whose transpose is the inverse regroup
    (regroup by sizes.T), another gather: autodiff would scatter-add into a zeroed copy of the rows."""
    return _regroup(x, sizes)


def _regroup(x, sizes):
    num_rows = x.shape[0]
    in_start = exclusive_cumsum(sizes.reshape(-1)).reshape(sizes.shape)  # [P, Q]
    out_sizes = sizes.T.reshape(-1)  # segments in (q, p) order
    out_end = jnp.cumsum(out_sizes)
    i = jnp.arange(num_rows, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(out_end, i, side="right"), out_sizes.shape[0] - 1)
    within = i - (out_end[seg] - out_sizes[seg])
    q, p = seg // sizes.shape[0], seg % sizes.shape[0]
    source = in_start[p, q] + within
    valid = i < out_end[-1]
    gathered = x[jnp.where(valid, source, 0)]
    return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), gathered, 0)


def _regroup_forward(x, sizes):
    return _regroup(x, sizes), sizes


def _regroup_backward(sizes, cotangent):
    return _regroup(cotangent, sizes.T), None


regroup.defvjp(_regroup_forward, _regroup_backward)


def exchange(x: Shaped[Array, "rows *feat"], sizes: Int[Array, "R R"], *, out_rows: int,
             gpus_per_node: int, backend: str = "auto", capacity: int | None = None,
             axes: tuple[str, str] = ("node", "gpu")) -> Shaped[Array, "out *feat"]:
    """Send rows between the R = N * G ranks of the (node, gpu) mesh; call inside shard_map.

    x: this rank's rows, those for destination d contiguous and in d order (sizes[me, d] of them).
    sizes: [R, R] rows from each source to each destination, identical on every rank.
    Returns [out_rows, ...]: the rows from each source s, in s order (sizes[s, me] each), then zeros.
    capacity: the most rows one source sends one destination (the dense back end pads to it);
    default x.shape[0], which never drops a row.

    Rank 0 of two, sizes [[1, 2], [3, 1]]: it keeps x[0], sends x[1:3] to rank 1, receives 3 rows
    from rank 1 and returns [x[0], r1_0, r1_1, r1_2, 0 ...].
    """
    backend = resolve_backend(backend)
    node_axis, gpu_axis = axes
    capacity = x.shape[0] if capacity is None else capacity
    me = jax.lax.axis_index(node_axis) * gpus_per_node + jax.lax.axis_index(gpu_axis)
    return _stage(x, sizes, me, axes, out_rows, backend, capacity)
