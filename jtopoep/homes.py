"""Where the home experts live: the statistics a layer keeps and the on-device re-placement.

A layer's placement i32[R, H] names the logical expert in each home slot. Every `moe.replace_every`
steps it is recomputed from two averages the layer keeps as state (exponential moving averages of
per-step values, identical on every device):
- loads f32[E]: pairs routed to each expert;
- co-activation f32[E, E]: tokens that chose both experts (`coactivation`).

`replace_homes` is a fixed number of parallel rounds (sorts, segment sums; no loop over R, E or the
moves), deterministic, so every rank computes the same placement bit for bit:
1. Nodes. Every expert starts on its old node. (With `band_width` w, experts sorted by load are cut
   into bands of N * w and every node must take w of every band, keeping old nodes where it can
   (`banded_assign`); the default is one band, no constraint.)
2. Swaps. Rounds of swaps between paired nodes (a round-robin schedule), within a band: every pair of
   nodes scores every swap of its experts by the objective, the co-activation kept inside nodes less
   `balance` x the spread of node loads, and makes its mutual-best swaps (or else its single best).
   So experts that tokens choose together gather on one node, and the deduplicated dispatch
   (jtopoep.relay) sends such a token across once, while hot experts stay spread over the nodes, so
   that each step's copies of them can stay on their node. A swap must gain more than `min_gain`
   (of the total co-activation; so that noise in the averages does not move experts across nodes at
   every re-placement), and a round is kept only if the objective rises: the result never falls
   below the start.
3. Ranks. Within each node, experts are dealt to the G ranks back and forth by load (the hottest G
   one each, the next G in reverse order, ...), so that rank loads are balanced too, and each rank's
   share takes the old rank of its hottest expert that stays, where it can; within a rank, experts
   that stay keep their order. A layer that has seen no routing keeps its placement.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jtopoep.ordering import first_argmax, inverse_permutation
from jtopoep.plan import home_rank_of_experts
from jtopoep.topology import Topology

# Co-activation is summed in integers (exact, so every rank sums the same), scaled to this total: any
# sum of its entries, and any swap's gain, fits int32.
_COACT_TOTAL = 1 << 28
_LOAD_TOTAL = 1 << 24


def coactivation(expert_ids: Int[Array, "T k"], num_experts: int) -> Int[Array, "E E"]:
    """Tokens that chose each pair of distinct experts, symmetric, zero diagonal."""
    a, b = expert_ids[:, :, None], expert_ids[:, None, :]
    index = (a * num_experts + b).reshape(-1)
    distinct = (a != b).astype(jnp.int32).reshape(-1)
    return jnp.zeros(num_experts * num_experts, jnp.int32).at[index].add(distinct).reshape(num_experts, num_experts)


def _rank_within_groups(group: Int[Array, " n"]) -> Int[Array, " n"]:
    """For each item, how many items before it share its group."""
    order = jnp.argsort(group, stable=True)
    sorted_group = group[order]
    first = jnp.searchsorted(sorted_group, sorted_group, side="left")
    rank_sorted = jnp.arange(group.shape[0], dtype=jnp.int32) - first.astype(jnp.int32)
    return rank_sorted[inverse_permutation(order)]


def banded_assign(preferred: Int[Array, "bands m"], bins: int, width: int) -> Int[Array, "bands m"]:
    """Bin of each item, every band giving each of `bins` bins exactly `width` items (m = bins * width).

    preferred: each item's bin of choice, or -1 for none. Within a band, the first `width` items that
    choose a bin keep it; the rest fill the bins' free places in bin order, in item order.

    One band, 2 bins of width 1, preferred [1, 1]: the first keeps bin 1, the second gets bin 0."""

    def one_band(p):
        key = jnp.where(p >= 0, p, bins)
        keep = (p >= 0) & (_rank_within_groups(key) < width)
        kept = jnp.zeros(bins + 1, jnp.int32).at[key].add(keep.astype(jnp.int32))[:bins]
        # Places (bin, j), j < width; a bin's first `kept` places are taken by its keepers.
        place_bin = jnp.repeat(jnp.arange(bins, dtype=jnp.int32), width)
        place_free = jnp.tile(jnp.arange(width, dtype=jnp.int32), bins) >= kept[place_bin]
        free_bins = place_bin[jnp.argsort(~place_free, stable=True)]  # free places first, in bin order
        newcomer = jnp.cumsum(~keep) - 1
        return jnp.where(keep, p, free_bins[jnp.clip(newcomer, 0, bins * width - 1)])

    return jax.vmap(one_band)(preferred)


@functools.lru_cache(maxsize=None)
def round_robin(num_nodes: int, rounds: int) -> np.ndarray:
    """int32 [rounds, N]: each node's partner per round (itself when it sits out), the circle method;
    successive rounds pair every node with every other before repeating."""
    n = num_nodes + num_nodes % 2
    out = np.zeros((rounds, num_nodes), np.int32)
    for t in range(rounds):  # static, on the host: a schedule, not a data-dependent loop
        circle = [0] + [1 + (t + i) % (n - 1) for i in range(n - 1)]
        partner = np.arange(n)
        for i in range(n // 2):
            a, b = circle[i], circle[n - 1 - i]
            partner[a], partner[b] = b, a
        partner = np.where(partner >= num_nodes, np.arange(n), partner)[:num_nodes]
        out[t] = partner
    return out


def _within(coact: Int[Array, "E E"], node: Int[Array, " E"], num_nodes: int) -> Int[Array, "E N"]:
    """affinity[e, n]: co-activation of expert e with the experts on node n (exact integer sums)."""
    return jax.ops.segment_sum(coact.T, node, num_nodes).T


def _swap_round(coact, load, node, band_items, partner, num_nodes: int, width: int, balance: float,
                min_gain: float):
    """One round of swaps between paired nodes within bands: the new node of every expert, kept only
    if it raises the objective (co-activation kept inside nodes, less `balance` x node-load spread)."""
    experts = jnp.arange(node.shape[0])

    def objective(node):
        affinity = _within(coact, node, num_nodes)
        node_load = jax.ops.segment_sum(load, node, num_nodes).astype(jnp.float32) / _LOAD_TOTAL
        kept = affinity[experts, node].sum().astype(jnp.float32) / _COACT_TOTAL
        return affinity, node_load, kept - balance * num_nodes * (node_load ** 2).sum()

    affinity, node_load, before = objective(node)
    gain = affinity[experts, partner[node]] - affinity[experts, node]  # moving e to its node's partner
    # items[b, a, i]: the i-th expert of band b on node a (each node holds `width` of every band).
    items = jnp.take_along_axis(band_items, jnp.argsort(node[band_items], axis=1, stable=True), axis=1)
    items = items.reshape(band_items.shape[0], num_nodes, width)
    # Each pair of nodes scores every swap of its experts from the lower node's side: [b, a, i, j] is
    # expert i of node a (the lower) trading places with expert j of its partner.
    low = jnp.minimum(jnp.arange(num_nodes), partner)
    mine, mate = items[:, low, :, None], items[:, partner[low], None, :]
    kept = (gain[mine] + gain[mate] - 2 * coact[mine, mate]).astype(jnp.float32) / _COACT_TOTAL
    shift = (load[mine] - load[mate]).astype(jnp.float32) / _LOAD_TOTAL
    spread = 2 * shift * (shift - (node_load[low] - node_load[partner[low]])[None, :, None, None])
    score = jnp.where((partner[low] != low)[None, :, None, None], kept - balance * num_nodes * spread, -jnp.inf)
    # Candidate 1: swaps that are each other's best (disjoint by construction) and pay on their own.
    mutual = ((first_argmax(score, axis=3)[..., None] == jnp.arange(width)[None, None, None, :])
              & (first_argmax(score, axis=2)[:, :, None, :] == jnp.arange(width)[None, None, :, None])
              & (score > min_gain))
    # Candidate 2: each pair of nodes' single best swap (when swaps made together interfere).
    flat = score.transpose(1, 0, 2, 3).reshape(num_nodes, -1)
    single = (jnp.arange(flat.shape[1])[None, :] == first_argmax(flat, axis=1)[:, None]) & (flat > min_gain)
    single = single.reshape(num_nodes, *score.shape[:1], width, width).transpose(1, 0, 2, 3)
    is_low = (jnp.arange(num_nodes) == low)[None, :, None]
    best, best_node = before, node
    for swap in (mutual, single):
        moves = jnp.where(is_low, swap.any(axis=3), swap.any(axis=2))  # [b, a, i] from each node's side
        new_node = node.at[items.reshape(-1)].set(
            jnp.where(moves, partner[:, None][None], jnp.arange(num_nodes)[:, None][None]).reshape(-1),
            unique_indices=True)
        value = objective(new_node)[2]
        best_node = jnp.where(value > best, new_node, best_node)
        best = jnp.maximum(value, best)
    return best_node


def _ranks_in_node(old_rank: Int[Array, " C"], stays: Bool[Array, " C"], *, gpus: int) -> Int[Array, " C"]:
    """Rank within the node of each of its C experts (given hottest first): dealt to G groups back
    and forth (the hottest G one each, the next G in reverse order, ...), and each group named after
    the old rank of its hottest expert that stays on the node, where no hotter group took it."""
    position = jnp.arange(old_rank.shape[0])
    forward = (position // gpus) % 2 == 0
    group = jnp.where(forward, position % gpus, gpus - 1 - position % gpus)
    # Each group's hottest staying expert: the first in hot-first order.
    first_stayer = jax.ops.segment_min(jnp.where(stays, position, old_rank.shape[0]), group, gpus)
    preferred = jnp.where(first_stayer < old_rank.shape[0], old_rank[jnp.minimum(first_stayer, old_rank.shape[0] - 1)],
                          -1)
    # Groups choose in order of their hottest member (group 0 holds the hottest expert).
    label = banded_assign(preferred[None, :], gpus, 1)[0]
    return label[group]


def replace_homes(loads: Float[Array, " E"], coact: Float[Array, "E E"], old: Int[Array, "R H"],
                  topology: Topology, *, band_width: int | None = None, rounds: int = 24,
                  balance: float = 0.75, min_gain: float = 5e-4) -> Int[Array, "R H"]:
    """A new placement [R, H] from the expected loads and co-activation; see the module docstring.
    Jittable, deterministic; every expert is placed exactly once."""
    num_ranks, home = old.shape
    num_experts = num_ranks * home
    nodes, gpus = topology.num_nodes, topology.gpus_per_node
    per_node = gpus * home
    if loads.shape != (num_experts,) or coact.shape != (num_experts, num_experts):
        raise ValueError(f"loads {loads.shape} and co-activation {coact.shape} must be [E] and [E, E] for the "
                         f"placement's E = {num_experts} experts")
    width = per_node if band_width is None else band_width
    if per_node % width:
        raise ValueError(f"band_width = {band_width} must divide the {per_node} home slots of a node")
    old_rank = home_rank_of_experts(old)
    old_node = old_rank // gpus
    load_share = jnp.floor(loads / jnp.maximum(loads.sum(), jnp.finfo(jnp.float32).tiny) * _LOAD_TOTAL
                           ).astype(jnp.int32)
    hot_first = jnp.argsort(-loads, stable=True).astype(jnp.int32)  # ties: lower expert first
    bands = hot_first.reshape(-1, nodes * width)

    node = jnp.zeros(num_experts, jnp.int32).at[bands.reshape(-1)].set(
        banded_assign(old_node[bands], nodes, width).reshape(-1), unique_indices=True)
    if nodes > 1 and rounds > 0:
        off_diagonal = coact * (1 - jnp.eye(num_experts, dtype=coact.dtype))
        total = jnp.maximum(off_diagonal.sum(), jnp.finfo(jnp.float32).tiny)
        scaled = jnp.floor(off_diagonal / total * _COACT_TOTAL).astype(jnp.int32)
        schedule = jnp.asarray(round_robin(nodes, rounds))
        node = jax.lax.fori_loop(0, rounds, lambda t, n: _swap_round(scaled, load_share, n, bands, schedule[t], nodes,
                                                                        width, balance, min_gain), node)

    # Ranks within each node: dealt back and forth by load, each rank's share named after an old rank
    # (_ranks_in_node), so that what need not move within a node stays.
    by_node = hot_first[jnp.argsort(node[hot_first], stable=True)].reshape(nodes, per_node)
    stays = old_node[by_node] == jnp.arange(nodes)[:, None]
    local = jax.vmap(functools.partial(_ranks_in_node, gpus=gpus))(old_rank[by_node] % gpus, stays)
    rank = jnp.zeros(num_experts, jnp.int32).at[by_node.reshape(-1)].set(
        (jnp.arange(nodes)[:, None] * gpus + local).reshape(-1), unique_indices=True)
    # Within a rank: experts that stay keep their order, newcomers follow by expert id.
    old_slot = inverse_permutation(old.reshape(-1))
    key = jnp.where(rank == old_rank, old_slot % home, home + jnp.arange(num_experts))
    order = jnp.lexsort((key, rank)).astype(jnp.int32).reshape(num_ranks, home)
    return jnp.where(loads.sum() > 0, order, old)  # no routing seen yet: nothing to go on
