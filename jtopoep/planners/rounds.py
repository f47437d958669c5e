"""Copies placed in a fixed number of parallel rounds: sorted spill laid against sorted room.

One round lays the items (experts, or pieces of experts bound for a node) end to end on a line,
largest first, and the bins (ranks, or nodes) likewise, and gives each bin the items its interval
overlaps, by how much they overlap: so each piece either fills a bin or ends an item, and a round
makes at most (items + bins) pieces; where those would outnumber the free guest slots, a round
instead gives each bin one item, the j-th largest to the j-th largest (pair_off). Each node gets a
line of its own (its experts or the pieces bound for it, against its ranks), all nodes at once as
rows. A sort along rows, prefix sums and comparisons within rows per round: no loop whose trip
count grows with the ranks, the experts or the copies.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int

from jtopoep.ordering import descending_key, key_range, stable_order
from jtopoep.planners.arrays import (carry_like, earlier_in_segment, exclusive_prefix_sum, order_by, overlap,
                                     pairwise_or_sorted, prefix_sum, scatter_add, segmented_prefix_sum)
from jtopoep.planners.problem import CopyProblem, Pricing, Shipped, paying_pieces, ship, spill_per_expert


# The most an expert may spill, in ranks' worth of the largest room, for ranks to take one piece each
# where slots are scarce (slots_are_scarce): a hotter expert needs several ranks in one round, which
# only the layout end to end gives it.
PAIRED_SPILL_PER_ROOM = 2

# Up to this many bins in a row, their places on the line come from comparing every pair (B^2 work in
# a few fused kernels); past it, from a sort and a binary search.
_COMPARED_BINS = 16


def _items_largest_first(size: Int[Array, " I"], rows: Int[Array, "S n"]) -> Int[Array, "S n"]:
    """Each row's items, largest first, ties to the lower id: ordering.stable_order's packing by id,
    one sort of each row's packed keys."""
    num_ids = size.shape[0]
    return jnp.sort(descending_key(size[rows], key_range(num_ids)) * num_ids + rows, axis=1) % num_ids


def _bins_largest_first(bin_size: Int[Array, "S B"]) -> tuple[Int[Array, "S B"], Int[Array, "S B"]]:
    """(order, place): each row's bins largest first, ties to the lower column, and each bin's place
    in that order (the order sorted back, where a scatter would be a loop over its updates on
    XLA:CPU's loop emitters)."""
    bound = key_range(bin_size.size)
    order = stable_order(descending_key(bin_size, bound), bound)
    return order, stable_order(order, bin_size.shape[1])


def _bins_ahead(bin_size: Int[Array, "S B"]) -> Bool[Array, "S B B"]:
    """[s, b, c]: whether bin c comes before bin b in its row, largest first, ties to the lower column:
    a comparison of every pair, for rows of few bins (_COMPARED_BINS)."""
    key = descending_key(bin_size, key_range(bin_size.size))
    column = jnp.arange(bin_size.shape[1])
    return (key[:, None, :] < key[:, :, None]) | ((key[:, None, :] == key[:, :, None])
                                                 & (column[None, None, :] < column[None, :, None]))


def match(size: Int[Array, " I"], rows: Int[Array, "S n"], bin_size: Int[Array, "S B"], width: int
          ) -> tuple[Int[Array, "S B W"], Int[Array, "S B W"]]:
    """(item, pairs) of the first `width` items each bin's interval overlaps, and by how much (0
    where fewer overlap). Items are ids in [0, I) with sizes `size`; row s of `rows` holds the items
    that meet row s of bins (a node's experts or pieces against its ranks). Within each row, items
    and bins are laid end to end largest first (ties to the lower id, bins to the lower column).

    One sort of each row's packed keys, a prefix sum along rows, and each bin's place on the line:
    where a row's bins are few (a node's ranks), from comparing them all; where they are many (the
    nodes, at scale), from a sort of the row and a binary search, whose work grows as B log B, not B^2."""
    num_bins = bin_size.shape[1]
    line = _items_largest_first(size, rows)
    length = size[line]
    item_hi = prefix_sum(length, 1)
    if num_bins <= _COMPARED_BINS:
        bin_lo = (_bins_ahead(bin_size) * bin_size[:, None, :]).sum(2)
        first = (item_hi[:, None, :] <= bin_lo[:, :, None]).sum(2, dtype=jnp.int32)  # items wholly before it
    else:
        # The same order (descending size, ties to the lower column), one sort per row.
        order, place = _bins_largest_first(bin_size)
        before = exclusive_prefix_sum(jnp.take_along_axis(bin_size, order, 1), 1)
        bin_lo = jnp.take_along_axis(before, place, 1)
        first = jax.vmap(functools.partial(jnp.searchsorted, side="right", method="scan_unrolled"))(
            item_hi, bin_lo).astype(jnp.int32)
    return _pieces(line, length, item_hi, first, bin_lo, bin_size, width)


def _pieces(line: Int[Array, "S n"], length: Int[Array, "S n"], item_hi: Int[Array, "S n"], first: Int[Array, "S B"],
            bin_lo: Int[Array, "S B"], bin_size: Int[Array, "S B"], width: int
            ) -> tuple[Int[Array, "S B W"], Int[Array, "S B W"]]:
    """(item, pairs) of the `width` items from each bin's first overlapping one on its row's line
    (items laid end to end: `line`, their lengths and where each ends), by how much each overlaps
    the bin [bin_lo, bin_lo + bin_size); 0 past the row's items."""
    num_rows, num_items = line.shape
    index = first[:, :, None] + jnp.arange(width)  # [S, B, W]
    safe = jnp.minimum(index, num_items - 1).reshape(num_rows, -1)
    hi = jnp.take_along_axis(item_hi, safe, 1).reshape(index.shape)
    lo = hi - jnp.take_along_axis(length, safe, 1).reshape(index.shape)
    amount = jnp.where(index < num_items, overlap(lo, hi, bin_lo[:, :, None], (bin_lo + bin_size)[:, :, None]), 0)
    return jnp.take_along_axis(line, safe, 1).reshape(index.shape), amount


def match_pairs(size: Int[Array, " I"], rows: Int[Array, "S n"], bin_size: Int[Array, "S B"], width: int,
                pair_row: Int[Array, " P"], pair_bin: Int[Array, " P"]) -> tuple[Int[Array, "P W"], Int[Array, "P W"]]:
    """match's pieces for the chosen (row, bin) pairs only: where a caller keeps few bins of each
    row's many (TAOT's flows, a destination's few largest sources), the pieces of all of them would be
    [S, B, W] gathers for [P, W] kept. Each chosen bin's place on its row's line from comparing it
    with the row's bins ([P, B] work, no sort of the rows)."""
    line = _items_largest_first(size, rows)[pair_row]  # [P, n]
    length = size[line]
    item_hi = prefix_sum(length, 1)
    bins = bin_size[pair_row]  # [P, B]
    mine = jnp.take_along_axis(bins, pair_bin[:, None], 1)  # [P, 1]
    key = descending_key(bins, key_range(bin_size.size))  # match's order: largest first, ties to the lower column
    column = jnp.arange(bin_size.shape[1])[None, :]
    mine_key = jnp.take_along_axis(key, pair_bin[:, None], 1)
    ahead = (key < mine_key) | ((key == mine_key) & (column < pair_bin[:, None]))
    bin_lo = jnp.where(ahead, bins, 0).sum(1, keepdims=True)  # [P, 1]
    first = (item_hi <= bin_lo).sum(1, dtype=jnp.int32, keepdims=True)  # items wholly before it
    item, amount = _pieces(line, length, item_hi, first, bin_lo, mine, width)  # one bin a row: [P, 1, W]
    return item[:, 0], amount[:, 0]


def pair_off(size: Int[Array, " I"], rows: Int[Array, "S n"], bin_size: Int[Array, "S B"]
             ) -> tuple[Int[Array, "S B 1"], Int[Array, "S B 1"]]:
    """(item, pairs) for each bin: within each row, the j-th largest bin takes the j-th largest item,
    up to the smaller of the two (ties to the lower id, bins to the lower column). Unlike match, no
    item's remainder runs on into the next bin, where it would take a slot for a sliver: what an
    item has left waits for the next round."""
    num_items = rows.shape[1]
    if bin_size.shape[1] <= _COMPARED_BINS:  # each bin's place: how many come before it
        place = _bins_ahead(bin_size).sum(2, dtype=jnp.int32)
    else:
        _, place = _bins_largest_first(bin_size)
    item = jnp.take_along_axis(_items_largest_first(size, rows), jnp.minimum(place, num_items - 1), 1)
    amount = jnp.where(place < num_items, jnp.minimum(size[item], bin_size), 0)
    return item[:, :, None], amount[:, :, None]


class Copies(NamedTuple):
    """Guest copies made so far. What each home slot keeps is carried; each rank's load, room and
    its experts' spill follow from it."""
    guests: Int[Array, "R K"]  # expert in each guest slot, -1 empty
    quotas: Int[Array, "R K"]  # pairs each guest slot takes
    kept: Int[Array, " E"]  # pairs each expert's home slot keeps
    shipped: Shipped

    @classmethod
    def start(cls, problem: CopyProblem, guest_slots: int, gpus_per_node: int) -> "Copies":
        num_ranks = problem.rank_loads.shape[0]
        return cls(jnp.full((num_ranks, guest_slots), -1, jnp.int32), jnp.zeros((num_ranks, guest_slots), jnp.int32),
                   problem.loads, Shipped.none(num_ranks, problem.loads.shape[0], num_ranks // gpus_per_node))

    @property
    def used(self) -> Int[Array, " R"]:
        return (self.guests >= 0).sum(1).astype(jnp.int32)

    def rank_loads(self, placement) -> Int[Array, " R"]:
        return self.kept[placement].sum(1) + self.quotas.sum(1)

    def room(self, problem: CopyProblem, placement) -> Int[Array, " R"]:
        return jnp.maximum(problem.target - self.rank_loads(placement), 0)

    def open_room(self, problem: CopyProblem, placement) -> Int[Array, " R"]:
        """Room on ranks with a free guest slot."""
        return jnp.where(self.used < self.guests.shape[1], self.room(problem, placement), 0)

    def spill(self, problem: CopyProblem, placement) -> Int[Array, " E"]:
        """Each rank's excess over the target, attributed to what its home slots keep, hottest first,
        the pairs shed last (CopyProblem.shed_last) after the rest."""
        excess = self.rank_loads(placement) - self.kept[placement].sum(1)  # its guests' pairs
        return spill_per_expert(self.kept, placement, problem.target - excess, home_slot=problem.home_slot,
                                shed_last=problem.shed_last)


def share_out(expert: Int[Array, " P"], want: Int[Array, " P"], available: Int[Array, " E"]) -> Int[Array, " P"]:
    """What each of P wants of its expert's available pairs, first come first served."""
    segment = jnp.where(want > 0, expert, available.shape[0])

    def pairwise():
        before = jnp.where(earlier_in_segment(segment), want[None, :], 0).sum(1)
        return jnp.clip(available[jnp.maximum(expert, 0)] - before, 0, want)

    def in_sorted_order():
        order = order_by(segment, available.shape[0] + 1)
        in_order = want[order]
        before = segmented_prefix_sum(in_order, segment[order], available.shape[0] + 1) - in_order
        granted = jnp.clip(available[jnp.maximum(expert[order], 0)] - before, 0, in_order)
        return jnp.zeros_like(want).at[order].set(granted, unique_indices=True)

    return pairwise_or_sorted(want.shape[0], pairwise, in_sorted_order)


def top_up(copies: Copies, problem: CopyProblem, placement) -> tuple[Int[Array, "R K"], Int[Array, "R K"]]:
    """Proposals [R, K] that fill the room left on ranks whose guest slots are all taken, by taking
    more of their guests' pairs off those guests' home slots (the room then opens on the homes,
    which have free slots). Each asks for up to all its home keeps: the caller shares them out."""
    slots = copies.guests.shape[1]
    room = jnp.where(copies.used == slots, copies.room(problem, placement), 0)
    available = copies.kept[jnp.maximum(copies.guests, 0)]
    want = jnp.where(copies.guests >= 0, available, 0)
    # The rank's slots in order:
    return copies.guests, jnp.clip(room[:, None] - (prefix_sum(want, 1) - want), 0, want)


def place(copies: Copies, expert: Int[Array, "R W"], amount: Int[Array, "R W"], problem: CopyProblem,
          placement: Int[Array, "R H"], pricing: Pricing | None, held: Int[Array, "R K"] | None,
          gpus_per_node: int, overshed: bool = False) -> Copies:
    """Copies after proposals for each rank (expert, pairs; 0 for none), those that pay made at once.

    A proposal for an expert the rank already holds as a guest adds to that copy; the others fill
    the rank's free slots in order, and a rank gets at most as many new experts as it has free
    slots. overshed: a copy into a rank's last free slot that would leave room there takes that
    room too, as far as its expert's home slot keeps pairs: the room then opens on the home rank,
    whose free slots can take what still spills (with few slots, the room sits on the few cold
    ranks while many experts spill)."""
    num_ranks, slots = copies.guests.shape
    width = expert.shape[1]
    expert = jnp.where(amount > 0, expert, -1)
    existing = (copies.guests[:, None, :] == expert[:, :, None]) & (expert[:, :, None] >= 0)  # [R, W, K]
    new = (expert >= 0) & ~existing.any(2)
    position = copies.used[:, None] + prefix_sum(new.astype(jnp.int32), 1) - 1
    amount = jnp.where(new & (position >= slots), 0, amount)
    new = new & (amount > 0)
    if overshed:
        left = copies.room(problem, placement) - amount.sum(1)  # [R]
        last = new & (position == slots - 1) & (left[:, None] > 0)
        kept_after = copies.kept - scatter_add(copies.kept.shape, (jnp.maximum(expert, 0).reshape(-1),),
                                               amount.reshape(-1))
        extra = jnp.where(last, jnp.minimum(left[:, None], kept_after[jnp.maximum(expert, 0)]), 0)
        # A rank has one last free slot: share over the R ranks, not the R x W proposals.
        granted = share_out(jnp.where(last, expert, 0).sum(1), extra.sum(1), kept_after)
        amount = amount + jnp.where(last, granted[:, None], 0)
    holds = (jnp.zeros((num_ranks, width), bool) if held is None
             else (held[:, None, :] == expert[:, :, None]).any(2))
    dest = jnp.broadcast_to(jnp.arange(num_ranks, dtype=jnp.int32)[:, None], expert.shape)
    flat = [x.reshape(-1) for x in (expert, dest, amount, new, holds)]
    made, kinds = paying_pieces(*flat, problem, copies.shipped, pricing, gpus_per_node)
    made = made.reshape(num_ranks, width)
    amount = jnp.where(made, amount, 0)
    new = new & made
    position = copies.used[:, None] + prefix_sum(new.astype(jnp.int32), 1) - 1
    into = new[:, :, None] & (position[:, :, None] == jnp.arange(slots)[None, None, :])  # [R, W, K]
    guests = jnp.where(into.any(1), (jnp.where(into, expert[:, :, None], 0)).sum(1), copies.guests)
    added = (jnp.where(into | (existing & made[:, :, None]), amount[:, :, None], 0)).sum(1)
    return Copies(guests, copies.quotas + added,
                  copies.kept - scatter_add(copies.kept.shape, (jnp.maximum(expert, 0).reshape(-1),),
                                            amount.reshape(-1)),
                  ship(copies.shipped, *(x.reshape(-1) for x in (expert, dest, amount, new)), kinds, problem,
                       gpus_per_node))


def within_nodes(copies: Copies, problem: CopyProblem, placement: Int[Array, "R H"], gpus_per_node: int
                 ) -> tuple[Int[Array, "R K"], Int[Array, "R K"]]:
    """Proposals [R, K] that keep each node's spill on its own ranks: its experts against its ranks'
    room, both largest first."""
    num_ranks, slots = copies.guests.shape
    nodes = num_ranks // gpus_per_node
    spill, room = copies.spill(problem, placement), copies.open_room(problem, placement)
    item, amount = match(spill, placement.reshape(nodes, -1), room.reshape(nodes, gpus_per_node), slots)
    return item.reshape(num_ranks, slots), amount.reshape(num_ranks, slots)


def onto_ranks_of_nodes(piece_expert: Int[Array, " P"], piece_amount: Int[Array, " P"], node_pieces: Int[Array, "N n"],
                        room: Int[Array, " R"], gpus_per_node: int, slots: int, paired: Bool[Array, ""] | bool = False):
    """Proposals [R, K] that spread pieces (expert, pairs) over the ranks of the node each is bound
    for (row n of node_pieces: the pieces bound for node n): the node's pieces against its ranks'
    room, both largest first; laid end to end (match), or where `paired`, one piece a rank (pair_off).
    paired: a device bool, or True or False where the caller knows."""
    num_ranks = room.shape[0]
    node_room = room.reshape(num_ranks // gpus_per_node, gpus_per_node)
    def one_a_rank():
        return (jnp.pad(x, ((0, 0), (0, 0), (0, slots - 1))) for x in pair_off(piece_amount, node_pieces, node_room))

    if paired is True:
        item, amount = one_a_rank()
    else:
        item, amount = match(piece_amount, node_pieces, node_room, slots)
        if paired is not False:  # both, and a select on device: a lax.cond would have XLA:GPU read `paired` on the host
            one_item, one_amount = one_a_rank()
            item, amount = jnp.where(paired, one_item, item), jnp.where(paired, one_amount, amount)
    return piece_expert[item].reshape(num_ranks, slots), amount.reshape(num_ranks, slots)


def slots_are_scarce(copies: Copies, problem: CopyProblem, placement) -> Bool[Array, ""]:
    """Whether ranks should take one piece each (pair_off) rather than the spill laid end to end over
    them (match): where the layout could cut the spill into more pieces (items + ranks - 1, over the
    ranks with room) than those ranks have free slots, slivers at the ranks' edges would take slots
    that whole pieces need (a node's hot experts all spilling onto the other nodes' ranks). Not where
    an expert spills more than PAIRED_SPILL_PER_ROOM times the largest room: its pieces then need
    many ranks in one round, which the layout gives them."""
    room = copies.open_room(problem, placement)
    bins = (room > 0).sum()
    free_slots = jnp.where(room > 0, copies.guests.shape[1] - copies.used, 0).sum()
    spill = copies.spill(problem, placement)
    return ((spill > 0).sum() + bins - 1 > free_slots) & (spill.max() <= PAIRED_SPILL_PER_ROOM * room.max())


def onto_nodes(spill: Int[Array, " E"], room: Int[Array, " R"], gpus_per_node: int, slots: int):
    """Pieces (expert, pairs), [N * G * K] each, that send what each expert still spills to nodes
    with room, both largest first, and the pieces bound for each node [N, G * K]."""
    nodes = room.shape[0] // gpus_per_node
    node_room = room.reshape(nodes, gpus_per_node).sum(1)
    width = gpus_per_node * slots
    item, amount = match(spill, jnp.arange(spill.shape[0], dtype=jnp.int32)[None, :], node_room[None, :], width)
    return item.reshape(-1), amount.reshape(-1), jnp.arange(nodes * width, dtype=jnp.int32).reshape(nodes, width)


def onto_demand(copies: Copies, problem: CopyProblem, placement: Int[Array, "R H"], gpus_per_node: int,
                least: Int[ArrayLike, ""], width: int) -> tuple[Int[Array, "R W"], Int[Array, "R W"]]:
    """Proposals [R, width] that lay each expert's spill onto the nodes whose own sources send it
    pairs no slot there takes yet, up to those pairs, node after node from its home node on: a copy
    there keeps them on their node, so they cross no link. Pieces under `least` pairs are left to
    later rounds (a slot spent on a sliver); each node's largest pieces against its ranks' room,
    `width` a rank at most (the rest of its slots stay for the balancing rounds)."""
    num_ranks, slots = copies.guests.shape
    nodes, num_experts = problem.node_loads.shape
    rank_node = jnp.arange(num_ranks, dtype=jnp.int32) // gpus_per_node
    hosted = scatter_add((nodes, num_experts), (jnp.broadcast_to(rank_node[:, None], copies.guests.shape),
                                                jnp.maximum(copies.guests, 0)),
                         jnp.where(copies.guests >= 0, copies.quotas, 0))
    spill = copies.spill(problem, placement)
    home_node = problem.home_rank // gpus_per_node
    at_home = jnp.arange(nodes, dtype=jnp.int32)[:, None] == home_node[None, :]
    # The home slot keeps its own node's pairs first; what it cannot keep of them is demand there too.
    demand = jnp.maximum(problem.node_loads - hosted - jnp.where(at_home, (copies.kept - spill)[None, :], 0), 0)
    # Each expert's nodes in turn from its home node (copies there ship weights over NVLink only),
    # so hot experts' first remote copies land on different nodes. The demand ahead of node n in
    # that turn is the prefix sum from the home node h, wrapping round: before[n] - before[h], plus
    # the whole column where n < h (no [N, E] rotation: a gather of one row per expert).
    before = exclusive_prefix_sum(demand, 0)  # [N, E]
    node = jnp.arange(nodes, dtype=jnp.int32)[:, None]
    ahead = before - before[home_node, jnp.arange(num_experts)][None, :] + jnp.where(
        node < home_node[None, :], demand.sum(0, dtype=jnp.int32)[None, :], 0)
    piece = jnp.clip(spill[None, :] - ahead, 0, demand)
    piece = jnp.where(piece >= least, piece, 0)
    # A node has gpus x slots guest slots: only its largest pieces can each get one. float32 keys:
    # XLA:CPU's top_k is a fast kernel for floats only (an int32 one sorts whole rows).
    _, expert = jax.lax.top_k(piece.astype(jnp.float32), min(gpus_per_node * slots, num_experts))  # [N, G K]
    piece = jnp.take_along_axis(piece, expert, axis=1)
    node_pieces = jnp.arange(piece.size, dtype=jnp.int32).reshape(piece.shape)
    return onto_ranks_of_nodes(expert.reshape(-1), piece.reshape(-1), node_pieces, copies.open_room(problem, placement),
                               gpus_per_node, width)


def across_nodes(copies: Copies, problem: CopyProblem, placement: Int[Array, "R H"], pricing: Pricing | None,
                 held: Int[Array, "R K"] | None, gpus_per_node: int,
                 rounds: int) -> Copies:
    """`rounds` rounds of, decided together and priced at once: top up the room left behind full
    slots; what spills, onto the nodes with most room, then onto each node's ranks with most room
    (over-shedding into last slots), laid end to end or, where slots are scarce at the start, one
    piece a rank. Each round places what the rounds before left for want of a free slot or of room;
    one with nothing left to place changes nothing, so the loop may stop once no spill is left
    (run_rounds: on CPU a loop that stops early, elsewhere the rounds unrolled)."""
    slots = copies.guests.shape[1]
    scarce = slots_are_scarce(copies, problem, placement)

    def one_round(copies):
        # Top-ups go to ranks whose slots are full, the spill to ranks with a free slot: one
        # placement decides both, the two sharing each home's pairs first come first served.
        full_expert, full_amount = top_up(copies, problem, placement)
        room = copies.open_room(problem, placement)
        pieces = onto_nodes(copies.spill(problem, placement), room, gpus_per_node, slots)
        open_expert, open_amount = onto_ranks_of_nodes(*pieces, room, gpus_per_node, slots, paired=scarce)
        expert = jnp.concatenate([full_expert, open_expert], 1)
        amount = jnp.concatenate([full_amount, open_amount], 1)
        amount = share_out(expert.reshape(-1), amount.reshape(-1), copies.kept).reshape(amount.shape)
        return place(copies, expert, amount, problem, placement, pricing, held, gpus_per_node, overshed=True)

    return run_rounds(one_round, carry_like(copies, problem.loads), lambda c: c.spill(problem, placement).sum() > 0,
                      rounds)


# Platforms where run_rounds stops early. A data-dependent while loop costs nothing on CPU, but
# XLA:GPU copies its exit test to the host and blocks on the stream after every iteration: a host
# sync inside the training step. Elsewhere the rounds run their static count, unrolled.
EARLY_EXIT_PLATFORMS: tuple[str, ...] = ("cpu",)


def run_rounds(one_round, carry, busy, rounds: int):
    """one_round applied `rounds` times, or on EARLY_EXIT_PLATFORMS only while busy(carry): the same
    result whenever a round applied to a carry that is not busy changes nothing."""
    def early(c):
        return jax.lax.while_loop(lambda ic: (ic[0] < rounds) & busy(ic[1]), lambda ic: (ic[0] + 1, one_round(ic[1])),
                                  (jnp.int32(0), c))[1]

    def fixed(c):
        # Unrolled: a GPU runs the planner launch-bound, and XLA fuses one round's last kernels
        # with the next round's first, which a loop body's boundary keeps apart.
        return jax.lax.fori_loop(0, rounds, lambda _, c: one_round(c), c, unroll=True)

    return jax.lax.platform_dependent(carry, default=fixed, **{name: early for name in EARLY_EXIT_PLATFORMS})


__all__ = ["Copies", "across_nodes", "match", "match_pairs", "onto_demand", "onto_nodes", "onto_ranks_of_nodes",
           "pair_off", "place", "run_rounds", "slots_are_scarce", "within_nodes"]
