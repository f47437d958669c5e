"""One MoE layer's expert-parallel data flow, called inside shard_map over ("node", "gpu").

    x f[T, D], expert_ids i[T, k], gates f[T, k]          this rank's tokens and router output
    counts  = all_gather(bincount(expert_ids))  i[R, E]  identical on every rank
    quotas  = planner.quotas(counts, placement, held)     identical on every rank: the expert in each
              slot and the pairs it takes (held: the guest experts kept from the previous
              micro-batch, or None)
    route   : this rank's row of the route, route[me, d, j], and its node's columns, cut to the
              receive buffers (jtopoep.rank_route): O(R x S) a rank, never the [R, R, S] whole
    assign  : pair p -> (rank d, slot j): on this source the pairs of expert e, in [T, k] order,
              fill the slots holding e in ascending (d, j) order, route[me, d, j] each
    exchange: hierarchical (the default on several nodes): each token once to every node it
              reaches, fanned out there over NVLink (jtopoep.relay); flat: the pairs sorted by
              destination slot, send sizes route[me].sum(1), straight to their ranks
              (transport.exchange_rows); either way regrouped at the destination by slot
    guests  : each guest slot's weights fanned out from its expert's home rank, or kept
              from the previous micro-batch of the step (jtopoep.guests), in `weight_chunks`
              slices of the hidden width, each its own transfer
    experts : SwiGLU over the S = H + K slots with jax.lax.ragged_dot, group sizes route[:, me].sum(0):
              one grouped GEMM for the home slots and one per slice for the guest slots, so that the
              home GEMM does not depend on the guest weights and each slice's GEMM only on its own,
              and XLA may overlap the transfers with them
    return  : the reverse exchanges, and the gate-weighted sum over the k choices (the relay
              dispatch sums a token's pairs on each node before the row goes back)

Receive buffer: a rank receives at most R*T*k rows (every source sending it every pair), and the
grouped GEMM runs over the whole buffer: XLA expands `ragged_dot` into a dense dot masked per group
unless a grouped-GEMM kernel takes it over. `recv_rows` bounds the buffer (and each relay's). A plan
that would send a rank (or a relay) more is cut to fit, in (source, slot) order, and the pairs that
do not fit are not computed, Switch-style: they add nothing to their token, which keeps its
residual. `DispatchStats.dropped` counts them (the same on every rank); the trainer logs them per
layer, or stops (moe.on_overflow). With recv_rows at least the plan's largest rank load nothing is
cut, and the layer is exact.

Everything is differentiable: the transpose of each exchange is the reverse exchange, so gradients of
guest-slot weights travel back to the home rank and add into the home expert's gradient.
Traffic per rank and layer (forward): T*k rows of D sent and received in total, plus 3*D*F weights per
guest slot received (none for a copy kept from the previous micro-batch); the backward pass moves the
same again in the opposite direction (every guest slot's gradient, kept copy or not).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jtopoep.gemm import grouped_matmul, sweeps_whole_buffer, takes_first_row
from jtopoep.guests import ExpertWeights, GuestCopies, fetch_guest_weights, hidden_slice, join_hidden
from jtopoep.ordering import inverse_permutation, stable_order
from jtopoep.planners.base import PlannerBase, home_quotas
from jtopoep.planners.none import NonePlanner
from jtopoep.planners.routing import SlotQuotas
from jtopoep.rank_route import rank_route
from jtopoep.relay import relay_dispatch, relay_worst_rows
from jtopoep.swiglu_tiled import tiled_swiglu
from jtopoep.transport import exchange_rows, exclusive_cumsum, regroup


class DispatchStats(NamedTuple):
    counts: Int[Array, "R E"]  # all-gathered routing counts of this layer
    quotas: SlotQuotas  # the planner's slots and quotas, before any cut to the receive buffer
    dropped: Int[Array, ""]  # pairs the receive buffers could not take (0: the layer is exact)
    planned_crossing: Int[Array, ""]  # pairs the plan sends across nodes, before any cut
    # Token rows that crossed nodes, every rank's summed: one per (token, node) reached with the
    # deduplicated hierarchical dispatch, one per pair without.
    scaleout_rows: Int[Array, ""]
    # This rank's guest copies after the layer, for the next micro-batch of the same optimizer step
    # (moe_dispatch's `previous`); None when the plan has no guest slots.
    guests: GuestCopies | None = None


def receive_rows(capacity_factor: float, pairs_per_rank: int, num_ranks: int) -> int:
    """Rows of each rank's receive buffer: capacity_factor x its own pairs (T * k), at most R * T * k,
    the most any rank can receive; factor 0 is that most (MoEConfig.recv_capacity_factor)."""
    worst = num_ranks * pairs_per_rank
    return worst if capacity_factor == 0 else min(worst, math.ceil(capacity_factor * pairs_per_rank))


def assign_slots(expert_ids: Int[Array, " A"], local_counts: Int[Array, " E"], slot_expert: Int[Array, "R S"],
                 sent: Int[Array, "R S"], partial: bool = False) -> Int[Array, " A"]:
    """Flat destination slot d * S + j of each of this source's pairs, by the plan's rule: the pairs of
    expert e, in order, fill the slots holding e in ascending (d, j) order, sent[d, j] each (this
    source's row of the route).

    partial: the route may send fewer pairs of an expert than this source has (a receive buffer cut
    it); those left over, the last of the expert's pairs, get R * S, past every slot."""
    num_pairs = expert_ids.shape[0]
    num_experts = local_counts.shape[0]
    order = stable_order(expert_ids, num_experts)
    expert_start = exclusive_cumsum(local_counts)
    rank_in_sorted = jnp.arange(num_pairs, dtype=jnp.int32) - expert_start[expert_ids[order]]
    # position of each pair on the line of all this source's pairs, laid out expert by expert
    line_sorted = expert_start[expert_ids[order]] + rank_in_sorted
    slot_expert = slot_expert.reshape(-1)
    num_slots = slot_expert.shape[0]
    sent = sent.reshape(-1)  # [R*S]
    holder = jnp.where(slot_expert >= 0, slot_expert, num_experts)  # expert of each slot, E if empty
    if partial:
        # Keys e * (R*S + 1) + slot leave one more entry after each expert's slots: the pairs they do
        # not take, sent nowhere.
        stride = num_slots + 1
        taken = jnp.zeros(num_experts + 1, jnp.int32).at[holder].add(sent)
        experts = jnp.arange(num_experts, dtype=jnp.int32)
        key = jnp.concatenate([holder * stride + jnp.arange(num_slots), experts * stride + num_slots])
        sent = jnp.concatenate([sent, local_counts - taken[:num_experts]])
    else:
        stride = num_slots
        key = holder * stride + jnp.arange(num_slots)
    slot_order = stable_order(key, (num_experts + 1) * stride)
    slot_end = jnp.cumsum(sent[slot_order])
    dest_sorted = jnp.minimum(slot_order[jnp.searchsorted(slot_end, line_sorted, side="right")], num_slots)
    return jnp.zeros(num_pairs, jnp.int32).at[order].set(dest_sorted.astype(jnp.int32), unique_indices=True)


def _swiglu_slots(x, weights: ExpertWeights, group_sizes, gemm: str):
    gate = grouped_matmul(x, weights.gate, group_sizes, gemm)
    up = grouped_matmul(x, weights.up, group_sizes, gemm)
    return grouped_matmul(jax.nn.silu(gate) * up, weights.down, group_sizes, gemm)


def expert_ffn(x: Float[Array, "rows D"], home_weights: ExpertWeights,
               guest_slices: tuple[ExpertWeights, ...] | None, group_sizes: Int[Array, " S"],
               gemm: str = "xla", single_pass: bool | None = None) -> Float[Array, "rows D"]:
    """SwiGLU of each row with its slot's expert; rows in slot order, group_sizes[j] rows for slot j
    (the H home slots, then the K guest slots); rows past the groups come out as zeros. gemm: the
    grouped GEMM (jtopoep.gemm).
    guest_slices: the guest slots' weights as slices of the hidden width (guests.hidden_slice), or
    None without guest slots.

    Home and guest slots are separate grouped GEMMs, not one over concatenated weights: the home GEMM
    then does not wait for the guest weights, so XLA can run the guest-weight transfer during it (the
    overlap the cost model prices), and in the backward pass the guest gradients can leave before the
    home weight gradients are done. Likewise each guest slice is its own grouped GEMM, and their
    outputs add up (SwiGLU sums over hidden units): slice c waits only for its own transfer. With
    moe.gemm=tiled all of it is one pass of tiled loops into one output buffer
    (jtopoep.swiglu_tiled); otherwise the guest rows are rotated to the front of the buffer and back
    (a permutation, so its transpose adds nothing twice).

    single_pass (default: whether the GEMM's cost follows the buffer's rows, jtopoep.gemm): one GEMM
    per hidden slice over every slot, home and guest weights side by side, so the buffer is swept
    once, not once by the home GEMM and again by the guest GEMM. Slice c then waits for guest slice
    c; the slices after the first still overlap with the transfers of the next."""
    if single_pass is None:
        single_pass = sweeps_whole_buffer(gemm)
    if single_pass and guest_slices is not None:
        chunks, out = len(guest_slices), None
        for c, part in enumerate(guest_slices):
            with jax.named_scope(f"slice{c}"):
                home = hidden_slice(home_weights, c, chunks)
                joined = ExpertWeights(*(jnp.concatenate([h, g]) for h, g in zip(home, part)))
                y = _swiglu_slots(x, joined, group_sizes, gemm)
            out = y if out is None else out + y
        return out
    if takes_first_row(gemm):  # the tiled loops: one pass over home and guest slots, one output buffer
        return tiled_swiglu(x, home_weights, tuple(guest_slices or ()), group_sizes)
    rows = x.shape[0]
    home = home_weights.gate.shape[0]
    row = jnp.arange(rows)[:, None]
    home_rows = group_sizes[:home].sum()
    with jax.named_scope("home_ffn"):
        out = _swiglu_slots(x, home_weights, group_sizes[:home], gemm)
        out = jnp.where(row < home_rows, out, 0)
    if guest_slices is None:
        return out
    with jax.named_scope("guest_ffn"):
        rotated = jnp.roll(x, -home_rows, axis=0)
        guest = None
        for c, part in enumerate(guest_slices):
            with jax.named_scope(f"slice{c}"):
                y = _swiglu_slots(rotated, part, group_sizes[home:], gemm)
            guest = y if guest is None else guest + y
        guest = jnp.roll(guest, home_rows, axis=0)
    return jnp.where((row >= home_rows) & (row < group_sizes.sum()), guest, out)


def moe_dispatch(x: Float[Array, "T D"], expert_ids: Int[Array, "T k"], gates: Float[Array, "T k"],
                 weights: ExpertWeights, placement: Int[Array, "R H"], planner: PlannerBase, *,
                 backend: str = "auto", hierarchical: bool = False, recv_rows: int | None = None,
                 axes: tuple[str, str] = ("node", "gpu"), previous: GuestCopies | None = None,
                 weight_chunks: int = 1, gemm: str = "auto") -> tuple[Float[Array, "T D"], DispatchStats]:
    """The layer's expert computation for this rank's T tokens; call inside shard_map over `axes`.

    recv_rows: rows of each rank's receive buffer, which the grouped GEMM runs over; default (and at
    most) R * T * k, which always suffices. See the module docstring for what a smaller one does.
    previous: the guest copies this layer held after the previous micro-batch of the same optimizer
    step (its DispatchStats.guests). The planner is told which experts each rank holds (topoep keeps
    a copy where that balances as well), and guest slots that hold one again are not fetched
    (jtopoep.guests). Only valid while the weights are unchanged: start each step without it.
    weight_chunks: the guest weights travel, and their GEMMs run, in this many slices of the hidden
    width (jtopoep.guests), a divisor of it; the result is the same SwiGLU, summed by slice.
    gemm: the grouped GEMM of the expert slots (jtopoep.gemm)."""
    topology = planner.topology
    gpus = topology.gpus_per_node
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    num_ranks, num_experts = topology.num_ranks, planner.num_experts
    node, gpu = jax.lax.axis_index(axes[0]), jax.lax.axis_index(axes[1])

    with jax.named_scope("plan"):
        flat_ids = expert_ids.reshape(-1).astype(jnp.int32)
        local_counts = jnp.zeros(num_experts, jnp.int32).at[flat_ids].add(1)
        counts = jax.lax.all_gather(local_counts, axes)  # [R, E]
        if isinstance(planner, NonePlanner):
            quotas = home_quotas(counts, placement, 0)  # fast path: no guest slots at all
        else:
            quotas = planner.quotas(counts, placement, None if previous is None else previous.experts)
    home = placement.shape[1]
    num_slots = quotas.slot_expert.shape[1]
    worst = num_ranks * num_pairs  # every source sends all its pairs here
    recv_rows = worst if recv_rows is None else recv_rows
    if not 1 <= recv_rows <= worst:
        raise ValueError(f"recv_rows = {recv_rows} must be in [1, R * T * k = {worst}]")
    relay = hierarchical and topology.num_nodes > 1
    relay_worst = relay_worst_rows(topology.num_nodes, num_pairs)
    relay_rows = min(recv_rows, relay_worst)
    recv_cut = recv_rows if recv_rows < worst else None
    relay_cut = relay_rows if relay and relay_rows < relay_worst else None
    partial = recv_cut is not None or relay_cut is not None
    with jax.named_scope("route"):
        routes = rank_route(counts, quotas, planner.tiered, node, gpu, gpus, recv_rows=recv_cut, relay_rows=relay_cut,
                            node_axis=axes[0])

    with jax.named_scope("permute"):
        dest = assign_slots(flat_ids, local_counts, quotas.slot_expert, routes.sent, partial)
    my_route = routes.received(gpu)  # [s, S]
    group_sizes = my_route.sum(0)

    guest, copies = None, None
    if num_slots > home:
        with jax.named_scope("guest_weights"):
            guest = fetch_guest_weights(weights, quotas.slot_expert[:, home:], placement, node * gpus + gpu,
                                        previous=previous, chunks=weight_chunks, gpus_per_node=gpus, backend=backend)
        copies = GuestCopies(quotas.slot_expert[:, home:], join_hidden(guest))

    def experts(rows):
        return expert_ffn(rows, weights, guest, group_sizes, gemm)

    def stats(scaleout):
        return DispatchStats(counts, quotas, routes.dropped, routes.planned_crossing, scaleout, copies)

    if relay:
        with jax.named_scope("relay_dispatch"):
            y, rows = relay_dispatch(x, gates, dest.reshape(num_tokens, top_k), routes.node_columns, experts,
                                     gpus_per_node=gpus, relay_rows=relay_rows, recv_rows=recv_rows, backend=backend,
                                     axes=axes)
        own_node = jnp.arange(num_ranks) // gpus
        return y, stats(jnp.where(own_node[:, None] != jnp.arange(topology.num_nodes)[None, :], rows, 0).sum())

    with jax.named_scope("permute"):
        send_order = stable_order(dest, num_ranks * num_slots + int(partial))
        tokens = x[send_order // top_k]
        send, recv = routes.sent.sum(1), my_route.sum(1)  # [d], [s]

    with jax.named_scope("dispatch"):
        move = dict(gpus_per_node=gpus, backend=backend, axes=axes)
        received = exchange_rows(tokens, send, recv, out_rows=recv_rows, **move)
        by_slot = regroup(received, my_route)
    out = experts(by_slot)

    with jax.named_scope("combine"):
        back = regroup(out, my_route.T)
        returned = exchange_rows(back, recv, send, out_rows=num_pairs, capacity=num_pairs, **move)
        per_pair = returned[inverse_permutation(send_order)].reshape(num_tokens, top_k, -1)
        y = jnp.einsum("tkd,tk->td", per_pair, gates.astype(per_pair.dtype))
    return y, stats(routes.crossing)
