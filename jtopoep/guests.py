"""Guest-slot weights: fanned out from each expert's home rank, or kept from the previous micro-batch.

Called inside shard_map over ("node", "gpu"), from jtopoep.dispatch.

    guests  = plan.slot_expert[:, H:]           i[R, K]  every rank's guest experts (-1 empty)
    fetch   : each expert goes once to every other node holding copies of it (to the node's first
              holder, the relay), and directly to the holders on its own node; crossings are spread
              over the scale-out links at both ends, a home handing the ones past its node's share
              to peers over NVLink, a first holder leaving the ones past its share to peers that
              receive them; each relay passes its copy on to the holders of its node over NVLink
              (plan.guest_fetch; four exchanges, transport.exchange)
    backward: the transpose: each node's guest gradients are summed at its relay, which sends one
              sum back, through the peer that sent the copy where one did, to the home expert

A hot expert with copies on many ranks thus costs the scale-out links one transfer per node, not one
per copy, and those transfers leave from, and land on, several links of each node, not one.

Keeping copies across micro-batches. With gradient accumulation the weights do not change between
the micro-batches of one optimizer step, so a copy a rank already holds from the previous micro-batch
of the same layer is the copy it would fetch, bit for bit. `GuestCopies` carries a layer's copies
from one micro-batch to the next; a guest slot whose expert the rank still holds takes it locally,
and its home rank does not send it (with the ragged transport those rows are never on the wire).
The backward pass is unchanged: every guest slot's gradient goes home in its own micro-batch, as if
every copy had been fetched (a custom VJP, because autodiff would otherwise stop at the kept copy,
which is carried state, not a function of the parameters). So keeping copies saves the forward
weight transfers; for the same plan, losses and gradients are bitwise those of fetching every copy.

Streaming in slices. With chunks = n the weights travel as n slices of the hidden width F (slice c:
gate and up columns, down rows [c F/n, (c+1) F/n)), each its own exchange, and the caller runs the
guest GEMM slice by slice (jtopoep.dispatch.expert_ffn sums the slices' outputs, which is the SwiGLU
exactly: F is a sum over hidden units). Slice c's GEMM depends only on slice c's transfer, so XLA can
run the next slice's transfer during it; in the backward pass each slice's gradients leave as soon
as its backward is done (the overlap costmodel.exposed_weight_seconds prices).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jtopoep.ordering import first_argmax, stable_order
from jtopoep.plan import fetch_send_rows, guest_fetch, home_rank_of_experts
from jtopoep.transport import exchange, exclusive_cumsum


class ExpertWeights(NamedTuple):
    gate: Float[Array, "H D F"]
    up: Float[Array, "H D F"]
    down: Float[Array, "H F D"]


class GuestCopies(NamedTuple):
    """A layer's guest copies after one micro-batch, for the next micro-batch of the same step, as
    one rank sees them inside shard_map (MoELayer carries them per device outside it)."""
    experts: Int[Array, "R K"]  # every rank's guest-slot experts, -1 empty (the plan's guest columns)
    weights: ExpertWeights  # this rank's guest-slot weights, zeros in empty slots


def kept_slots(guests: Int[Array, "R K"], held: Int[Array, "R K"]) -> jax.Array:
    """bool [R, K]: guest slot (d, i) holds an expert that rank d already held (`held`), so nothing
    needs to be sent for it."""
    return (guests >= 0) & (guests[:, :, None] == held[:, None, :]).any(2)


def _deliver(rows, pick, src, me, move, num_guests: int, max_sends: int):
    """[K, F] rows for this rank's guest slots: every slot (d, i) with a sender src[d, i] gets, from
    that rank, the row pick[d, i] of the sender's `rows` ([n, F]); slots without one get zeros.
    A flat exchange: the fan-out already sends each expert across nodes once per node, and a
    two-stage exchange would pad its middle buffer to every node's rows of whole experts.
    max_sends: the most slots one rank can send to (the send buffer's rows; see _fetch).
    Linear in rows: a one-hot matmul picks them, whose transpose sums gradients with a dense dot,
    not a float scatter-add whose order could vary."""
    gpus_per_node, backend = move
    num_ranks = src.shape[0]
    sizes = (src[None, :, :] == jnp.arange(num_ranks)[:, None, None]).sum(2).astype(jnp.int32)  # [sender, d]
    mine = (src == me).reshape(-1)
    send_order = stable_order((~mine).astype(jnp.int32), 2)  # my (d, i) slots first, in (d, i) order
    which = pick.reshape(-1)[send_order[:max_sends]]
    send = (which[:, None] == jnp.arange(rows.shape[0])[None, :]).astype(rows.dtype) @ rows  # [max_sends, F]
    received = exchange(send, sizes, out_rows=num_guests, gpus_per_node=gpus_per_node, backend=backend,
                        capacity=num_guests)
    my_src = jax.lax.dynamic_index_in_dim(src, me, 0, keepdims=False)  # [K]
    earlier_same = (my_src[None, :] == my_src[:, None]) & (jnp.arange(num_guests)[None, :] < jnp.arange(num_guests)[:, None])
    offset = exclusive_cumsum(jax.lax.dynamic_index_in_dim(sizes, me, 1, keepdims=False))  # per sender
    position = offset[jnp.maximum(my_src, 0)] + earlier_same.sum(1)
    return jnp.where((my_src >= 0)[:, None], received[jnp.clip(position, 0, num_guests - 1)], 0)


def _after(x, previous):
    """(x, previous) through one optimization barrier: x is known only once `previous` is, so that an
    exchange of x starts after the one that made `previous` and XLA can reuse its buffers. Not on
    XLA:CPU, whose compiler crashed intermittently on the barrier inside the trainer's micro-batch
    loop, and whose dense emulation's memory it does not change."""
    if jax.default_backend() == "cpu":
        return x, previous
    return jax.lax.optimization_barrier((x, previous))


def _fetch(weights: ExpertWeights, guests, placement, me, skip, move) -> ExpertWeights:
    """[K, ...] weights of this rank's guest slots, fanned out from the experts' home ranks
    (plan.guest_fetch), in four exchanges: each home hands the copies a peer sends across for it to
    that peer (NVLink); then homes send to the holders on their own node; then homes and those peers
    send to one receiver on every other node holding the expert (its first holder, or a peer
    receiving for it); then each receiver passes its copy on to the other holders of its node (NVLink). Slots that are
    empty or `skip`ped [R, K] get zeros and nothing is sent for them. Linear in `weights`, so its
    transpose returns the gradients up the same tree."""
    gpus_per_node = move[0]
    num_ranks, home = placement.shape
    num_guests = guests.shape[1]
    home_rank = home_rank_of_experts(placement)
    home_slot = first_argmax(placement[home_rank] == jnp.arange(placement.size)[:, None], axis=1)  # [E]
    sent = (guests >= 0) & ~skip
    src, staged, received, received_from = guest_fetch(guests, placement, gpus_per_node, sent)
    rows = jnp.concatenate([w.reshape(home, -1) for w in weights], axis=1)  # [H, 3*D*F]
    hands, local, crossing, relays = fetch_send_rows(num_ranks, home, num_guests, gpus_per_node)
    # Stage 1, over NVLink: the staging rows [K] of the peers that send copies across for a home.
    staged_rows = _deliver(rows, home_slot[jnp.maximum(staged, 0)], jnp.where(staged >= 0, home_rank[staged], -1),
                           me, move, num_guests, hands) if hands else jnp.zeros((num_guests, rows.shape[1]), rows.dtype)
    # Stage 2: from a home (its own rows) or a peer sending for it (its staging rows), to slots of
    # the sender's node, and across to each crossing's receiver: a first holder's slot or a peer's
    # receiving row.
    expert = jnp.maximum(guests, 0)
    same_node = src // gpus_per_node == jnp.arange(num_ranks)[:, None] // gpus_per_node
    first_hop = sent & ((src == home_rank[expert]) | ~same_node)
    targets = jnp.concatenate([guests, received], axis=1)  # [R, 2K]: guest slots, then receiving rows
    sources = jnp.concatenate([jnp.where(first_hop, src, -1), received_from], axis=1)
    target_home = home_rank[jnp.maximum(targets, 0)]
    pick = jnp.where(sources == target_home, home_slot[jnp.maximum(targets, 0)],
                     home + first_argmax(staged[sources.clip(0)] == targets[:, :, None], axis=2))
    # In two exchanges, one after the other, so that their send buffers are not live together: homes
    # to the slots of their own node, then the crossings.
    payload = jnp.concatenate([rows, staged_rows])
    across = sources // gpus_per_node != jnp.arange(num_ranks)[:, None] // gpus_per_node
    got = _deliver(payload, pick, jnp.where(across, -1, sources), me, move, 2 * num_guests, local)
    if crossing:
        payload, got = _after(payload, got)
        got_across = _deliver(payload, pick, jnp.where(across, sources, -1), me, move, 2 * num_guests, crossing)
        my_across = jax.lax.dynamic_index_in_dim(across & (sources >= 0), me, 0, keepdims=False)  # [2K]
        got = jnp.where(my_across[:, None], got_across, got)
    # Stage 3, over NVLink: a relay sends the row holding the expert: its receiving row where it
    # received the crossing there, else its own guest slot.
    relayed = sent & ~first_hop
    in_received = (received[src.clip(0)] == guests[:, :, None])  # [R, K, K]
    relay_row = jnp.where(in_received.any(2), num_guests + first_argmax(in_received, axis=2),
                          first_argmax(guests[src.clip(0)] == guests[:, :, None], axis=2))
    mine = got[:num_guests]
    got = jnp.where(jax.lax.dynamic_index_in_dim(relayed, me, 0, keepdims=False)[:, None],
                    _deliver(got, relay_row, jnp.where(relayed, src, -1), me, move, num_guests, relays), mine)
    parts, start = [], 0
    for w in weights:
        size = w[0].size
        parts.append(got[:, start:start + size].reshape((num_guests,) + w.shape[1:]))
        start += size
    return ExpertWeights(*parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fetch_keeping(move, weights, held_weights, guests, held, placement, me):
    return _fetch_keeping_fwd(move, weights, held_weights, guests, held, placement, me)[0]


def _fetch_keeping_fwd(move, weights, held_weights, guests, held, placement, me):
    kept = kept_slots(guests, held)
    fetched = _fetch(weights, guests, placement, me, kept, move)
    my_guests = jax.lax.dynamic_index_in_dim(guests, me, 0, keepdims=False)  # [K]
    my_held = jax.lax.dynamic_index_in_dim(held, me, 0, keepdims=False)
    my_kept = jax.lax.dynamic_index_in_dim(kept, me, 0, keepdims=False)
    where = first_argmax(my_guests[:, None] == my_held[None, :], axis=1)  # slot of the kept copy
    out = ExpertWeights(*(jnp.where(my_kept.reshape((-1,) + (1,) * (f.ndim - 1)), h[where], f)
                          for f, h in zip(fetched, held_weights)))
    # The weights are a residual only for their type (shape, dtype, and the mesh axes they vary
    # over), which the backward's vjp needs; they are live anyway, so keeping them costs no memory.
    return out, (weights, guests, placement, me)


def _fetch_keeping_bwd(move, residuals, cotangent):
    weights, guests, placement, me = residuals
    # The gradient of a full fetch: every guest slot's gradient goes home, kept or not. (A vjp, not a
    # linear transpose, which cannot pass the exchanges' custom VJP; XLA drops the unused forward.)
    _, full_fetch_vjp = jax.vjp(lambda w: _fetch(w, guests, placement, me, guests < 0, move), weights)
    (grads,) = full_fetch_vjp(cotangent)
    return grads, None, None, None, None, None


_fetch_keeping.defvjp(_fetch_keeping_fwd, _fetch_keeping_bwd)


def hidden_slice(weights: ExpertWeights, chunk: int, chunks: int) -> ExpertWeights:
    """Slice `chunk` of `chunks` of the hidden width F: gate and up columns, down rows."""
    width = weights.gate.shape[-1] // chunks
    cut = slice(chunk * width, (chunk + 1) * width)
    return ExpertWeights(weights.gate[..., cut], weights.up[..., cut], weights.down[..., cut, :])


def join_hidden(slices) -> ExpertWeights:
    """The weights whose hidden_slice(., c, len(slices)) is slices[c]."""
    return ExpertWeights(jnp.concatenate([s.gate for s in slices], axis=-1),
                         jnp.concatenate([s.up for s in slices], axis=-1),
                         jnp.concatenate([s.down for s in slices], axis=-2))


def fetch_guest_weights(weights: ExpertWeights, guests: Int[Array, "R K"], placement: Int[Array, "R H"], me, *,
                        gpus_per_node: int, backend: str,
                        previous: GuestCopies | None = None, chunks: int = 1) -> tuple[ExpertWeights, ...]:
    """This rank's guest-slot weights, [K, ...] each, as `chunks` slices of the hidden width
    (hidden_slice), each fetched by its own exchange (`guests`: every rank's guest experts, -1
    empty; empty slots get zeros). previous: the copies this layer held after the previous
    micro-batch of the same optimizer step; slots that hold one of them again take it without a
    transfer. Its weights must be the copies of the current `weights` (the caller empties it at each
    step)."""
    hidden = weights.gate.shape[-1]
    if chunks < 1 or hidden % chunks:
        raise ValueError(f"chunks = {chunks} must be a positive divisor of the expert hidden width {hidden}")
    move = (gpus_per_node, backend)
    out = []
    for c in range(chunks):
        with jax.named_scope(f"slice{c}"):
            part = hidden_slice(weights, c, chunks)
            if out:
                # Slices travel one after another (they share the links anyway), so XLA can reuse
                # one slice's exchange buffers for the next: they are sized for the widest fan-out.
                part, _ = _after(part, out[-1])
            if previous is None:
                out.append(_fetch(part, guests, placement, me, guests < 0, move))
            else:
                out.append(_fetch_keeping(move, part, hidden_slice(previous.weights, c, chunks), guests,
                                          previous.experts, placement, me))
    return tuple(out)
