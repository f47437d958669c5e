"""Guest-slot weights: fetched from home, or kept from the previous micro-batch (jtopoep.guests)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pytest

from jtopoep.guests import ExpertWeights, GuestCopies, fetch_guest_weights, join_hidden, kept_slots
from jtopoep.plan import contiguous_placement, fetch_send_rows, guest_fetch
from jtopoep.topology import Topology, make_mesh

R, E, K, D, F = 8, 16, 3, 5, 4
SPEC = P(("node", "gpu"))
PLACEMENT = contiguous_placement(R, E)
# Every rank's guest experts (-1 empty), none homed on the rank itself (expert e lives on rank e // 2).
GUESTS = np.array([[5, 9, -1], [0, 14, 7], [1, 12, 6], [9, -1, -1],
                   [15, 2, 3], [0, 1, 3], [13, 8, -1], [4, 2, 11]], np.int32)
# The copies held after the previous micro-batch: some again in another column, some gone, some new.
HELD = np.array([[9, 5, -1], [6, 14, 3], [-1, -1, -1], [9, 10, 11],
                 [3, 2, 15], [4, 8, 10], [13, 8, 0], [11, 4, 2]], np.int32)
# Node 1 wants the experts of ranks 0 and 1 (0-3): node 0 sends 4 copies across, one per link, so
# ranks 0 and 1 each hand one to a peer (ranks 2 and 3) over NVLink; rank 4, first holder of three,
# receives one and ranks 6 and 7 receive the other two for it.
HOT = np.array([[9, -1, -1], [12, -1, -1], [-1, -1, -1], [-1, -1, -1],
                [0, 1, 2], [3, 0, -1], [1, 2, 3], [-1, 8, 0]], np.int32)


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return ExpertWeights(*(rng.normal(size=s).astype(np.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]))


@functools.lru_cache(maxsize=None)
def fetcher(keep: bool, chunks: int = 1):
    """jit(value_and_grad) of sum(cotangent * guest weights) on the 2x4 mesh, and the weights (the
    slices of the hidden width joined back)."""
    topo = Topology.preset("cpu-2x4")

    def body(guests, held, w, held_w, cot):
        me = jax.lax.axis_index("node") * topo.gpus_per_node + jax.lax.axis_index("gpu")
        previous = GuestCopies(held, ExpertWeights(*held_w)) if keep else None
        got = fetch_guest_weights(ExpertWeights(*w), guests, jnp.asarray(PLACEMENT), me, gpus_per_node=topo.gpus_per_node,
                                  backend="dense", previous=previous, chunks=chunks)
        assert len(got) == chunks and got[0].gate.shape[-1] == F // chunks
        got = join_hidden(got)
        loss = sum((g * c).sum() for g, c in zip(got, cot))
        return jax.lax.psum(loss, ("node", "gpu")), got

    fn = jax.shard_map(body, mesh=make_mesh(topo), in_specs=(P(), P(), SPEC, SPEC, SPEC), out_specs=(P(), SPEC))
    return jax.jit(jax.value_and_grad(lambda w, *a: fn(a[0], a[1], w, a[2], a[3]), has_aux=True))


def held_copies(w, marker):
    """[R * K, ...] weights of HELD: each held copy is its expert's weights + marker (0: exact copies)."""
    rows = np.maximum(HELD.reshape(-1), 0)
    return ExpertWeights(*(np.where((HELD.reshape(-1) >= 0)[:, None, None], x[rows] + marker, 0).astype(np.float32)
                           for x in w))


def test_fan_out_sends_each_expert_across_once_per_node():
    """Expert 3 (home rank 1, node 0) has copies on ranks 4 and 5 (node 1): the home sends it to
    rank 4, the node's first holder, which passes it on to rank 5; expert 0's copy on rank 1 (its
    home node) comes from home. Across nodes, one send per (expert, node holding copies of it)."""
    fetch = guest_fetch(jnp.asarray(GUESTS), PLACEMENT, 4)
    src = np.asarray(fetch.source)
    assert src[4, 2] == 1 and src[5, 2] == 4 and src[1, 0] == 0 and (src[GUESTS < 0] == -1).all()
    # No link here sends or receives more than its node's share across: nothing handed on.
    assert all((np.asarray(x) == -1).all() for x in fetch[1:])
    node = np.arange(R) // 4
    across = (src >= 0) & (node[np.maximum(src, 0)] != node[:, None])
    remote = {(g, node[d]) for d in range(R) for g in GUESTS[d] if g >= 0 and (g // 2) // 4 != node[d]}
    assert across.sum() == len(remote) < sum(1 for d in range(R) for g in GUESTS[d] if g >= 0 and (g // 2) // 4 != node[d])
    for got, want in zip(guest_fetch(GUESTS, np.asarray(PLACEMENT), 4, xp=np), fetch):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_crossings_past_a_links_share_go_through_peers_at_both_ends():
    """HOT: node 0 sends experts 0-3 across, two from each of ranks 0 and 1, and rank 4 is the
    first holder of three of them. A node's share is ceil(4 / 4) = 1 per link, so at the sending
    end each home sends its first over its own link and hands the second to ranks 2 and 3; at the
    receiving end rank 4 takes expert 0 and ranks 6 and 7 receive experts 1 and 2 for it, passing
    them on to their holders (rank 6 to itself too)."""
    fetch = guest_fetch(jnp.asarray(HOT), PLACEMENT, 4)
    src, staged, received, received_from = map(np.asarray, fetch)
    assert src[4].tolist() == [0, 6, 7] and src[5].tolist() == [3, 4, -1] and src[6].tolist() == [6, 7, 5]
    assert staged[2].tolist() == [1, -1, -1] and staged[3].tolist() == [3, -1, -1]
    assert (staged[[0, 1, 4, 5, 6, 7]] == -1).all()
    assert received[6].tolist() == [1, -1, -1] and received_from[6].tolist() == [2, -1, -1]
    assert received[7].tolist() == [2, -1, -1] and received_from[7].tolist() == [1, -1, -1]
    assert (received[:6] == -1).all()
    into_node_1 = np.concatenate([src[4:][(src[4:] >= 0) & (src[4:] < 4)], received_from[4:][received[4:] >= 0]])
    assert np.bincount(into_node_1, minlength=4).tolist() == [1, 1, 1, 1]  # one per sending link
    for got, want in zip(guest_fetch(HOT, np.asarray(PLACEMENT), 4, xp=np), fetch):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_kept_slots_are_the_experts_the_rank_still_holds():
    kept = np.asarray(kept_slots(jnp.asarray(GUESTS), jnp.asarray(HELD)))
    expected = np.array([[g >= 0 and g in HELD[d] for g in GUESTS[d]] for d in range(R)])
    np.testing.assert_array_equal(kept, expected)
    assert kept.sum() == 12 and not kept[0, 2]  # an empty slot is never kept, even where -1 is held


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("guests", [GUESTS, HOT], ids=["relays", "handed-to-peers"])
def test_fetch_puts_each_experts_weights_in_its_slot_and_sends_gradients_home(chunks, guests):
    w = weights()
    cot = weights(1)
    cot = ExpertWeights(*(np.resize(c, (R * K,) + c.shape[1:]) for c in cot))
    (_, got), grads = fetcher(False, chunks)(w, guests, HELD, held_copies(w, 0.0), cot)
    for x, g, c, dw in zip(w, got, cot, grads):
        rows = guests.reshape(-1)
        np.testing.assert_array_equal(np.asarray(g), np.where((rows >= 0)[:, None, None], x[np.maximum(rows, 0)], 0))
        # Each expert's gradient: the cotangents of the slots holding it.
        expected = np.zeros_like(x)
        np.add.at(expected, rows[rows >= 0], c[rows >= 0])
        np.testing.assert_allclose(np.asarray(dw), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunks", [1, 2])
def test_kept_copies_are_taken_locally_with_the_same_values_and_gradients(chunks):
    w = weights()
    cot = weights(1)
    cot = ExpertWeights(*(np.resize(c, (R * K,) + c.shape[1:]) for c in cot))
    (loss, fetched), grads = fetcher(False, chunks)(w, GUESTS, HELD, held_copies(w, 0.0), cot)
    (loss_kept, kept), grads_kept = fetcher(True, chunks)(w, GUESTS, HELD, held_copies(w, 0.0), cot)
    # Exact copies held: bitwise the fetch, and the same gradient (every slot's goes home).
    assert loss_kept == loss
    for a, b in zip(fetched + grads, kept + grads_kept):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Marked copies show which slots were taken from what the rank held: exactly the kept ones.
    (_, marked), grads_marked = fetcher(True, chunks)(w, GUESTS, HELD, held_copies(w, 1000.0), cot)
    is_kept = np.asarray(kept_slots(jnp.asarray(GUESTS), jnp.asarray(HELD))).reshape(-1)
    rows = np.maximum(GUESTS.reshape(-1), 0)
    for x, a, b in zip(w, fetched, marked):
        marked_copy = (x[rows] + np.float32(1000.0)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(b), np.where(is_kept[:, None, None], marked_copy, np.asarray(a)))
    for a, b in zip(grads, grads_marked):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_slices_must_divide_the_hidden_width():
    w = ExpertWeights(*map(jnp.asarray, weights()))
    with pytest.raises(ValueError, match=r"chunks = 3 must be a positive divisor of the expert hidden width 4"):
        fetch_guest_weights(w, jnp.asarray(GUESTS), jnp.asarray(PLACEMENT), 0, gpus_per_node=4, backend="dense",
                            chunks=3)


def test_fan_out_on_random_placements_sends_each_copy_across_once_spread_over_links():
    """Any placement, any guests, any held subset: every (expert, node) that needs a copy gets it
    across once, sent from a rank of its home's node and received by a rank of the holders' node,
    which passes it on to every holder there; at either end a link carries more than its node's
    share only when every link below the share has its K rows full; numpy and jnp agree."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        gpus, nodes = int(rng.choice([2, 4])), int(rng.integers(2, 5))
        home, slots = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        ranks, experts = gpus * nodes, gpus * nodes * home
        placement = rng.permutation(experts).reshape(ranks, home).astype(np.int32)
        home_of = np.zeros(experts, int)
        home_of[placement.reshape(-1)] = np.repeat(np.arange(ranks), home)
        hot = rng.integers(0, experts, 2)
        guests = np.full((ranks, slots), -1, np.int32)
        for d in range(ranks):
            pool = [e for e in list(range(experts)) + list(hot) * 4 if e not in placement[d]]
            chosen = list(dict.fromkeys(rng.choice(pool, slots)))
            guests[d, :len(chosen)] = chosen
        sent = (rng.random((ranks, slots)) < 0.9) & (guests >= 0)
        fetch = guest_fetch(guests, placement, gpus, sent, xp=np)
        for got, want in zip(guest_fetch(jnp.asarray(guests), jnp.asarray(placement), gpus, jnp.asarray(sent)),
                             fetch):
            np.testing.assert_array_equal(np.asarray(got), want)
        src, staged, received, received_from = fetch
        assert ((src >= 0) == sent).all()
        node = np.arange(ranks) // gpus
        # Each crossing: (expert, node it goes to) -> (sending rank, receiving rank).
        crossings = {}
        for d, i in zip(*np.nonzero(sent)):
            e, s = guests[d, i], src[d, i]
            if node[home_of[e]] == node[d]:
                assert s == home_of[e]
            elif node[s] != node[d]:  # this slot receives the crossing itself
                assert (e, node[d]) not in crossings
                crossings[(e, node[d])] = (s, d)
        for t, r in zip(*np.nonzero(received >= 0)):
            e = received[t, r]
            assert (e, node[t]) not in crossings
            crossings[(e, node[t])] = (received_from[t, r], t)
        assert set(crossings) == {(guests[d, i], node[d]) for d, i in zip(*np.nonzero(sent))
                                  if node[home_of[guests[d, i]]] != node[d]}
        for (e, n), (s, t) in crossings.items():
            assert node[s] == node[home_of[e]] and node[t] == n
            assert s == home_of[e] or e in staged[s]
        assert (staged >= 0).sum() == sum(s != home_of[e] for (e, _), (s, _) in crossings.items())
        # Every other holder takes it from the crossing's receiver, on its own node.
        for d, i in zip(*np.nonzero(sent)):
            e = guests[d, i]
            if node[home_of[e]] != node[d] and node[src[d, i]] == node[d]:
                assert src[d, i] == crossings[(e, node[d])][1]
        # No rank sends more rows in an exchange than its send buffer holds (plan.fetch_send_rows).
        bounds = fetch_send_rows(ranks, home, slots, gpus)
        across = node[np.maximum(src, 0)] != node[:, None]
        first_hop = sent & ((src == home_of[np.maximum(guests, 0)]) | across)
        per_rank = [np.bincount(home_of[staged[staged >= 0]], minlength=ranks),
                    np.bincount(src[first_hop & ~across], minlength=ranks),
                    np.bincount(np.concatenate([src[first_hop & across], received_from[received >= 0]]),
                                minlength=ranks),
                    np.bincount(src[sent & ~first_hop], minlength=ranks)]
        assert all(c.max() <= b for c, b in zip(per_rank, bounds)), (trial, per_rank)
        for end, rows in ((0, staged), (1, received)):
            links = np.bincount([c[end] for c in crossings.values()], minlength=ranks).reshape(nodes, gpus)
            share = -(-links.sum(1, keepdims=True) // gpus)
            full = (rows >= 0).sum(1).reshape(nodes, gpus) == slots
            over = (links > share).any(1)
            assert (~over | ((links >= share) | full).all(1)).all(), (trial, end)
