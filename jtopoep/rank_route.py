"""This rank's part of the route, cut to the receive buffers, without the whole [R, R, S].

Inside shard_map over ("node", "gpu") every rank holds the same counts and slot quotas, so the same
route lines (planners.routing.route_lines). From them a rank derives only what it moves:
- its node's columns, route[s, (node, g'), j] for every source s: O(R x S) entries. Each rank of
  the node cuts them to the receive buffers the same way, so it knows its own column (what it
  receives) and, as a relay, what it forwards, with no collective;
- its own row, route[me, d, j]: without a cut straight from the lines; with one, each node's cut
  row for this rank comes from the rank of the same GPU index there, one all-to-all over "node".

Cuts keep what lands first, Switch-style: a destination keeps rows in (source, slot) order up to
recv_rows, a relay forwards pairs in (source node, destination gpu, slot) order up to relay_rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jtopoep.planners.routing import RouteLines, SlotQuotas, route_block, route_lines
from jtopoep.transport import exclusive_cumsum


class RankRoute(NamedTuple):
    sent: Int[Array, "R S"]  # route[me, d, j] after the cuts: pairs this rank sends to each slot
    node_columns: Int[Array, "R G S"]  # route[s, (node, g'), j] after the cuts, for this rank's node
    dropped: Int[Array, ""]  # pairs the cuts dropped, every node's (the same on every rank)
    crossing: Int[Array, ""]  # pairs crossing nodes after the cuts, every node's
    planned_crossing: Int[Array, ""]  # pairs crossing nodes before the cuts, every node's

    def received(self, gpu) -> Int[Array, "R S"]:
        """route[s, me, j] after the cuts: pairs this rank (gpu `gpu` of its node) takes from each source."""
        return jax.lax.dynamic_index_in_dim(self.node_columns, gpu, 1, keepdims=False)


def cut_columns(columns: Int[Array, "R G S"], recv_rows: int) -> Int[Array, "R G S"]:
    """Each destination's rows cut to recv_rows in (source, slot) order: the order they land in."""
    by_dest = columns.transpose(1, 0, 2).reshape(columns.shape[1], -1)
    kept = jnp.clip(recv_rows - exclusive_cumsum(by_dest, axis=1), 0, by_dest)
    return kept.reshape(columns.shape[1], columns.shape[0], -1).transpose(1, 0, 2)


def cut_relays(columns: Int[Array, "R G S"], relay_rows: int) -> Int[Array, "R G S"]:
    """Each relay's forwarded pairs cut to relay_rows: relay g0 of the node forwards, from the
    sources (n', g0), in (n', destination gpu, slot) order."""
    num_ranks, gpus, num_slots = columns.shape
    nodes = num_ranks // gpus
    by_relay = columns.reshape(nodes, gpus, gpus * num_slots).transpose(1, 0, 2).reshape(gpus, -1)
    kept = jnp.clip(relay_rows - exclusive_cumsum(by_relay, axis=1), 0, by_relay)
    return kept.reshape(gpus, nodes, gpus * num_slots).transpose(1, 0, 2).reshape(columns.shape)


def rank_route(counts: Int[Array, "R E"], quotas: SlotQuotas, tiered: bool, node, gpu, gpus_per_node: int, *,
               recv_rows: int | None = None, relay_rows: int | None = None,
               node_axis: str = "node") -> RankRoute:
    """This rank's (node, gpu) part of the route of `quotas` (planners.routing), cut to recv_rows
    per destination and then to relay_rows per relay (None: no cut). Call inside shard_map."""
    num_ranks, num_slots = quotas.slot_expert.shape
    gpus = gpus_per_node
    row, planned = planned_route(counts, quotas, tiered, node, gpu, gpus)
    columns = planned
    if recv_rows is not None:
        columns = cut_columns(columns, recv_rows)
    if relay_rows is not None:
        columns = cut_relays(columns, relay_rows)
    remote = (jnp.arange(num_ranks) // gpus != node)[:, None, None]
    if recv_rows is None and relay_rows is None:
        sent = row
    else:
        # Rank (n, gpu) holds node n's cut columns; the sources of this GPU index, (n', gpu), take
        # their rows of them: [N, G, S] for each n', one all-to-all over the nodes.
        nodes = num_ranks // gpus
        rail = columns.reshape(nodes, gpus, gpus, num_slots)
        rail = jax.lax.dynamic_index_in_dim(rail, gpu, 1, keepdims=False)  # [n', g', j]: from (n', gpu)
        sent = jax.lax.all_to_all(rail, node_axis, 0, 0, tiled=True).reshape(num_ranks, num_slots)
    # Each rank of a node holds its node's figures: one sum over the nodes gives every rank the totals.
    dropped, crossing, planned_crossing = jax.lax.psum(jnp.stack([
        planned.sum() - columns.sum(), jnp.where(remote, columns, 0).sum(), jnp.where(remote, planned, 0).sum()]),
        node_axis)
    return RankRoute(sent, columns, dropped, crossing, planned_crossing)


def planned_route(counts: Int[Array, "R E"], quotas: SlotQuotas, tiered: bool, node, gpu, gpus_per_node: int
                  ) -> tuple[Int[Array, "R S"], Int[Array, "R G S"]]:
    """This rank's row and its node's columns of the route before any cut: what rank_route starts
    from, with no collective (a planner's cost in the layer is its quotas and this)."""
    num_slots = quotas.slot_expert.shape[1]
    lines = route_lines(counts, quotas.slot_expert, quotas.quota, gpus_per_node, tiered)
    return (_row(lines, node, gpu, gpus_per_node, num_slots),
            _node_columns(lines, node, gpus_per_node, num_slots))


def _node_columns(lines: RouteLines, node, gpus_per_node: int, num_slots: int) -> Int[Array, "R G S"]:
    num_ranks = lines.counts.shape[0]
    slots = node * gpus_per_node * num_slots + jnp.arange(gpus_per_node * num_slots, dtype=jnp.int32)
    block = route_block(lines, jnp.arange(num_ranks // gpus_per_node, dtype=jnp.int32), slots, gpus_per_node,
                        num_slots)
    return block.reshape(num_ranks, gpus_per_node, num_slots)


def _row(lines: RouteLines, node, gpu, gpus_per_node: int, num_slots: int) -> Int[Array, "R S"]:
    slots = jnp.arange(lines.slot_expert.shape[0], dtype=jnp.int32)
    block = route_block(lines, jnp.reshape(node, (1,)).astype(jnp.int32), slots, gpus_per_node, num_slots)
    return jax.lax.dynamic_index_in_dim(block, gpu, 0, keepdims=False).reshape(-1, num_slots)  # its node's rows
