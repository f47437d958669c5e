"""Re-placement of home experts (jtopoep.homes) and their migration (jtopoep.migration)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jtopoep.homes import banded_assign, coactivation, replace_homes, round_robin
from jtopoep.migration import migrate, migration_sizes, migration_traffic, slot_permutation
from jtopoep.plan import contiguous_placement, home_rank_of_experts
from jtopoep.topology import Topology, make_mesh


def test_coactivation_counts_pairs_of_one_token():
    ids = jnp.array([[0, 2], [2, 0], [1, 3]])
    got = np.asarray(coactivation(ids, 4))
    want = np.zeros((4, 4), int)
    want[0, 2] = want[2, 0] = 2
    want[1, 3] = want[3, 1] = 1
    np.testing.assert_array_equal(got, want)


def test_banded_assign_keeps_first_choices_and_fills_in_order():
    got = np.asarray(banded_assign(jnp.array([[1, 1, -1, 0], [0, 0, 0, 0]]), bins=2, width=2))
    # Band 0: both keep bin 1, the third (no choice) and the fourth (bin 0) fill bin 0.
    np.testing.assert_array_equal(got[0], [1, 1, 0, 0])
    # Band 1: the first two keep bin 0; the rest go to bin 1.
    np.testing.assert_array_equal(got[1], [0, 0, 1, 1])


@pytest.mark.parametrize("nodes", [2, 3, 4, 7])
def test_round_robin_pairs_every_node_with_every_other(nodes):
    schedule = round_robin(nodes, 2 * nodes)
    met = set()
    for partner in schedule:
        np.testing.assert_array_equal(partner[partner], np.arange(nodes))  # a matching
        met |= {(a, int(b)) for a, b in enumerate(partner) if a != b}
    assert met == {(a, b) for a in range(nodes) for b in range(nodes) if a != b}


def _is_placement(placement, num_experts):
    return sorted(np.asarray(placement).reshape(-1).tolist()) == list(range(num_experts))


@functools.lru_cache(maxsize=None)
def _jitted_replace(topology):
    return jax.jit(lambda *a: replace_homes(*a, topology))


def _statistics(rng, num_experts):
    loads = rng.pareto(1.0, num_experts).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, 3, replace=False) for _ in range(64)])
    return jnp.asarray(loads), jnp.asarray(coactivation(jnp.asarray(ids), num_experts), jnp.float32)


@settings(max_examples=20)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(2, 4, 2), (4, 2, 3), (1, 8, 2), (4, 8, 2)]))
def test_replace_homes_gives_a_placement(seed, shape):
    nodes, gpus, home = shape
    rng = np.random.default_rng(seed)
    num_experts = nodes * gpus * home
    old = rng.permutation(num_experts).reshape(nodes * gpus, home).astype(np.int32)
    new = _jitted_replace(Topology(nodes, gpus))(*_statistics(rng, num_experts), jnp.asarray(old))
    assert new.shape == old.shape and new.dtype == jnp.int32
    assert _is_placement(new, num_experts)


def test_replace_homes_is_deterministic():
    """Op by op and compiled, the same placement bit for bit."""
    topology = Topology(4, 2)
    rng = np.random.default_rng(3)
    loads, coact = _statistics(rng, 24)
    old = jnp.asarray(rng.permutation(24).reshape(8, 3).astype(np.int32))
    np.testing.assert_array_equal(replace_homes(loads, coact, old, topology),
                                  _jitted_replace(topology)(loads, coact, old))


def test_replace_homes_without_statistics_moves_nothing():
    topology = Topology(2, 4)
    old = jnp.asarray(np.random.default_rng(0).permutation(16).reshape(8, 2).astype(np.int32))
    new = replace_homes(jnp.zeros(16), jnp.zeros((16, 16)), old, topology)
    np.testing.assert_array_equal(new, old)


def test_replace_homes_gathers_coactivated_experts_and_spreads_hot_ones():
    # 4 nodes x 2 GPUs x 2 slots; tokens choose experts in groups of 4 ({0, 4, 8, 12}, ...) that
    # contiguous homes put on four nodes, and experts 0-3 are hot.
    topology = Topology(4, 2)
    groups = np.arange(16).reshape(4, 4).T
    ids = np.concatenate([np.tile(g, (50, 1)) for g in groups])
    loads = np.bincount(ids.reshape(-1), minlength=16).astype(np.float32) + (np.arange(16) < 4) * 40
    coact = np.asarray(coactivation(jnp.asarray(ids), 16), np.float32)
    old = contiguous_placement(8, 16)
    new = replace_homes(jnp.asarray(loads), jnp.asarray(coact), old, topology, balance=0.0)
    node = np.asarray(home_rank_of_experts(new)) // 2
    old_node = np.asarray(home_rank_of_experts(old)) // 2
    distinct = lambda n: np.mean([len(set(n[g])) for g in groups])  # noqa: E731
    assert distinct(node) < distinct(old_node)
    new_balanced = replace_homes(jnp.asarray(loads), jnp.asarray(coact), old, topology, balance=4.0)
    node_loads = lambda p: np.bincount(np.asarray(home_rank_of_experts(p)) // 2, loads, 4)  # noqa: E731
    assert node_loads(new_balanced).max() <= node_loads(old).max()


@pytest.mark.parametrize("topology", [Topology(2, 4), Topology(1, 8), Topology(4, 2)])
def test_migrate_is_the_permutation_gather_bitwise(devices, topology):
    num_ranks, home = topology.num_ranks, 3
    mesh = make_mesh(topology)
    rng = np.random.default_rng(7)
    old = rng.permutation(num_ranks * home).reshape(num_ranks, home).astype(np.int32)
    new = rng.permutation(num_ranks * home).reshape(num_ranks, home).astype(np.int32)
    array = jnp.asarray(rng.normal(size=(num_ranks * home, 5, 3)).astype(np.float32))
    moved = jax.jit(lambda a, o, n: migrate(a, o, n, mesh, topology, backend="dense"))(array, old, new)
    perm = np.asarray(slot_permutation(jnp.asarray(old), jnp.asarray(new)))
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(array)[perm])
    # Row r * H + h holds expert new[r, h], as row old-slot-of-it did before.
    by_expert_before = np.empty_like(np.asarray(array))
    by_expert_before[old.reshape(-1)] = np.asarray(array)
    np.testing.assert_array_equal(np.asarray(moved), by_expert_before[new.reshape(-1)])


def test_migration_sizes_and_traffic():
    old = jnp.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    new = jnp.array([[0, 2], [1, 3], [4, 6], [5, 7]])
    sizes = np.asarray(migration_sizes(old, new))
    assert sizes.sum() == 8 and np.trace(sizes) == 4
    traffic = migration_traffic(old, new, gpus_per_node=2)
    assert int(traffic["moved_intra"]) == 4 and int(traffic["moved_inter"]) == 0
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(traffic["moved"])), [1, 2, 5, 6])
