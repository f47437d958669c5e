"""Deduplicated two-stage token dispatch: each token crosses to each destination node once.

A token's k experts often sit on fewer than k nodes, and the scale-out link is the slow one. So,
inside shard_map over ("node", "gpu"), for this rank (node m, gpu g) and its T tokens:

    stage 1 (scale-out, rail-aligned)  each token goes once to every node n holding a slot one of its
             pairs is routed to, to the relay (n, g): the GPU with this rank's local index. With the
             row travel its k gates and, per pair, the local slot g' * S + j it goes to on n (-1 when
             the pair goes elsewhere), so the relay can expand it.
    stage 2 (scale-up)  the relay expands each row into its pairs and sends them over NVLink to their
             ranks, ordered (destination gpu, source node, slot): a destination receives, from every
             source, route[s, d, j] rows for each of its slots, as the flat exchange delivers them.
    combine  mirrors both: the relay sums the gate-weighted outputs of a token's pairs on its node and
             sends one row back; the source sums a token's rows, one per node.

Stage-1 sizes are not in the plan (they count distinct (token, node) rows): one all-gather of an
[R, N] count, beside the routing counts, gives them to every rank. Stage-2 sizes are the plan's own.

Sums are in float32 in a fixed order (choice by choice), so the result is bitwise deterministic. The
backward pass is JAX's transpose of the same gathers and exchanges, except the combine's sums, whose
rows are each gathered once, so their gradients are gathers too (weighted_row_sum).

Buffers: the relay's stage-1 and stage-2 buffers hold relay_rows rows each, the destination's
recv_rows; `rank_route.cut_relays` cuts a route so a relay never forwards more pairs than relay_rows
(a relay then never receives more stage-1 rows). The stage-1 buffer needs no more than N x T rows
either: a source sends a node each token at most once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jtopoep.ordering import inverse_permutation, stable_order
from jtopoep.transport import _stage, exclusive_cumsum, regroup


def relay_worst_rows(num_nodes: int, pairs_per_rank: int) -> int:
    """The most pairs one relay can forward: every source of its rail sends all its pairs to its node."""
    return num_nodes * pairs_per_rank


def _first_of_node(dest_node: Int[Array, "T k"], num_nodes: int) -> Array:
    """[T, k] bool: the choice is routed (node < N) and is the token's first choice on its node."""
    top_k = dest_node.shape[1]
    same = dest_node[:, :, None] == dest_node[:, None, :]  # [T, i, i']
    earlier = jnp.tril(jnp.ones((top_k, top_k), bool), -1)  # i' < i
    return (dest_node < num_nodes) & ~(same & earlier).any(-1)


def relay_dispatch(x: Float[Array, "T D"], gates: Float[Array, "T k"], dest: Int[Array, "T k"],
                   node_route: Int[Array, "R G S"], expert_fn, *, gpus_per_node: int, relay_rows: int, recv_rows: int,
                   backend: str, axes: tuple[str, str] = ("node", "gpu")
                   ) -> tuple[Float[Array, "T D"], Int[Array, "R N"]]:
    """The gate-weighted sum over each token's pairs of its experts' outputs, moved as described above,
    and the stage-1 sizes: distinct (token, node) rows from every source to every node.

    dest: each pair's flat destination slot d * S + j (R * S: sent nowhere, it adds nothing);
    node_route: route[s, (node, g'), j] after every cut for this rank's node (rank_route; it must
    agree with dest). expert_fn maps this rank's received rows [recv_rows, D], grouped by slot
    (route[:, me] summed over sources for each slot, slots in order), to their outputs."""
    node_axis, gpu_axis = axes
    num_tokens, top_k = dest.shape
    num_ranks, gpus, num_slots = node_route.shape
    nodes = num_ranks // gpus
    node = jax.lax.axis_index(node_axis)
    gpu = jax.lax.axis_index(gpu_axis)
    dtype = x.dtype

    # Stage 1 at the source: the rows (n, t) for each node n a token reaches, node by node.
    dest_rank = dest // num_slots
    dest_node = dest_rank // gpus  # N when sent nowhere
    local_slot = (dest_rank % gpus) * num_slots + dest % num_slots  # g' * S + j on its node
    first = _first_of_node(dest_node, nodes)
    reaches = jnp.zeros((nodes + 1, num_tokens), bool).at[
        jnp.where(first, dest_node, nodes), jnp.arange(num_tokens)[:, None]].set(True)[:nodes]  # [N, T]
    rows_to_nodes = jax.lax.all_gather(reaches.sum(1, dtype=jnp.int32), axes)  # [R, N]
    send_rows = num_tokens * min(top_k, nodes)  # the most distinct (token, node) rows a source has
    row_of = exclusive_cumsum(reaches.reshape(-1).astype(jnp.int32)).reshape(nodes, num_tokens)
    (sent,) = jnp.nonzero(reaches.reshape(-1), size=send_rows, fill_value=nodes * num_tokens)
    sent_node, sent_token = sent // num_tokens, sent % num_tokens  # node N: padding
    on_node = dest_node[sent_token] == sent_node[:, None]  # [rows, k]: the token's pairs on that node
    meta = jnp.where(on_node, local_slot[sent_token], -1)
    payload = jnp.concatenate([x[sent_token], jnp.where(on_node, gates[sent_token], 0).astype(dtype)], 1)

    across = rows_to_nodes.reshape(nodes, gpus, nodes)[:, gpu]  # [n', n]: rows from (n', gpu) to relay (n, gpu)
    first_capacity = min(num_tokens, relay_rows)
    arrived_rows = min(relay_rows, nodes * num_tokens)
    stage1 = dict(me=node, axis_name=node_axis, backend=backend, capacity=first_capacity)
    arrived = _stage(payload, across, out_rows=arrived_rows, **stage1)
    arrived_meta = _stage(meta, across, out_rows=arrived_rows, **stage1)

    # At the relay: expand each row into its pairs on this node, ordered (gpu g', source node n', slot j).
    arrived_end = jnp.cumsum(across[:, node])
    row = jnp.arange(arrived_rows, dtype=jnp.int32)
    from_node = jnp.searchsorted(arrived_end, row, side="right")  # N past the rows that arrived
    live = (from_node < nodes)[:, None] & (arrived_meta >= 0)  # [arrived_rows, k]
    dest_gpu, slot = arrived_meta // num_slots, arrived_meta % num_slots
    num_keys = gpus * nodes * num_slots
    key = jnp.where(live, (dest_gpu * nodes + from_node[:, None]) * num_slots + slot, num_keys).reshape(-1)
    full_order = stable_order(key, num_keys + 1)
    order = full_order[:relay_rows]  # live pairs first, and at most relay_rows of them (cut_relays)
    forward = arrived[order // top_k, :-top_k]
    # [g0, n', g']: pairs relay (node, g0) forwards from source (n', g0) to rank (node, g')
    within = node_route.reshape(nodes, gpus, gpus, num_slots).sum(-1).transpose(1, 0, 2)
    to_gpus = within.sum(1)  # [g0, g']
    second_capacity = min(relay_rows, recv_rows)
    stage2 = dict(me=gpu, axis_name=gpu_axis, backend=backend, capacity=second_capacity)
    received = _stage(forward, to_gpus, out_rows=recv_rows, **stage2)
    # Rows arrive by relay g0, then source node n'; the flat order is by source s = n' * G + g0.
    from_relays = within[:, :, gpu]  # [g0, n']
    my_route = jax.lax.dynamic_index_in_dim(node_route, gpu, 1, keepdims=False)  # [s, S]
    by_slot = regroup(regroup(received, from_relays), my_route)

    out = expert_fn(by_slot)

    # Combine: back to the relays in the order they sent, then one gate-weighted row per token and node.
    back = regroup(regroup(out, my_route.T), from_relays.T)
    returned = _stage(back, to_gpus.T, out_rows=relay_rows, **stage2)
    position = inverse_permutation(full_order).reshape(arrived_rows, top_k)  # live pairs: < relay_rows
    arrived_gates = arrived[:, -top_k:].astype(jnp.float32)
    summed = weighted_row_sum(returned, jnp.minimum(position, relay_rows - 1), arrived_gates, live)
    home = _stage(summed.astype(dtype), across.T, out_rows=send_rows, **stage1)

    # At the source: a token's rows from the nodes it reached, summed choice by choice.
    at = row_of[jnp.minimum(dest_node, nodes - 1), jnp.arange(num_tokens)[:, None]]  # [T, k]
    y = weighted_row_sum(home, jnp.minimum(at, send_rows - 1), first.astype(jnp.float32), first)
    return y.astype(dtype), rows_to_nodes


@jax.custom_vjp
def weighted_row_sum(rows: Float[Array, "n D"], index: Int[Array, "T k"], weight: Float[Array, "T k"],
                     valid: Bool[Array, "T k"]) -> Float[Array, "T D"]:
    """out[t] = sum over i of weight[t, i] * rows[index[t, i]] where valid[t, i], in float32, choice
    by choice (a fixed order of summation). The valid entries of `index` are distinct, so each row's
    gradient is one entry's: a gather by the inverse index, where autodiff would scatter-add every
    choice into its own zeroed copy of `rows` (k of them live at once in the backward pass)."""
    out = None
    for i in range(index.shape[1]):
        term = jnp.where(valid[:, i:i + 1], weight[:, i:i + 1] * rows[index[:, i]].astype(jnp.float32), 0)
        out = term if out is None else out + term
    return out


def _weighted_row_sum_forward(rows, index, weight, valid):
    return weighted_row_sum(rows, index, weight, valid), (rows, index, weight, valid)


def _weighted_row_sum_backward(residuals, grad):
    rows, index, weight, valid = residuals
    num_rows, (num_tokens, top_k) = rows.shape[0], index.shape
    entry = jnp.arange(num_tokens * top_k, dtype=jnp.int32)
    # The entry each row was gathered by, -1 where none (entries not valid land past the rows).
    owner = jnp.full(num_rows + 1, -1, jnp.int32).at[jnp.where(valid, index, num_rows).reshape(-1)].set(
        entry, unique_indices=True)[:num_rows]
    taken = owner >= 0
    owner = jnp.maximum(owner, 0)
    grad_rows = jnp.where(taken[:, None], weight.reshape(-1)[owner][:, None] * grad[owner // top_k], 0)
    grad_weight = jnp.stack([jnp.where(valid[:, i], (grad * rows[index[:, i]].astype(jnp.float32)).sum(1), 0)
                             for i in range(top_k)], axis=1)
    return grad_rows.astype(rows.dtype), None, grad_weight.astype(weight.dtype), None


weighted_row_sum.defvjp(_weighted_row_sum_forward, _weighted_row_sum_backward)
