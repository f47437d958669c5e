"""Locality-tiered routing and spill attribution against plain loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.plan import check_plan
from jtopoep.planners.common import spill_per_expert
from jtopoep.planners.routing import plan_from_quotas

RANKS, EXPERTS, GUESTS, GPUS = 8, 16, 2, 4  # two nodes of four ranks


def random_layout(seed):
    """Counts, slots and quotas of a valid plan: random guest copies, each expert's load split at
    random over its copies."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 30, (RANKS, EXPERTS)) * (rng.random((RANKS, EXPERTS)) < 0.7)
    placement = np.arange(EXPERTS).reshape(RANKS, -1)
    home = placement.shape[1]
    guests = np.full((RANKS, GUESTS), -1)
    for d in range(RANKS):
        others = [e for e in range(EXPERTS) if e not in placement[d]]
        picked = rng.choice(others, size=rng.integers(0, GUESTS + 1), replace=False)
        guests[d, :len(picked)] = picked
    slot_expert = np.concatenate([placement, guests], axis=1)
    quota = np.zeros_like(slot_expert)
    loads = counts.sum(0)
    for e in range(EXPERTS):
        where = np.argwhere(slot_expert == e)
        cuts = np.sort(rng.integers(0, loads[e] + 1, len(where) - 1))
        for (d, j), q in zip(where, np.diff(np.concatenate([[0], cuts, [loads[e]]]))):
            quota[d, j] = q
    return counts.astype(np.int32), slot_expert.astype(np.int32), quota.astype(np.int32), home


def fill(supply, capacity, route, sources, copies):
    """Greedy in order: each source, in rank order, fills the copies in rank order."""
    for s in sources:
        for c in copies:
            moved = min(supply[s], capacity[c])
            supply[s] -= moved
            capacity[c] -= moved
            route[s][c] += moved


def reference_route(counts, slot_expert, quota, tiered):
    """[s, d, j] pairs, one expert at a time, with explicit loops."""
    route = np.zeros((RANKS,) + slot_expert.shape, np.int64)
    node = np.arange(RANKS) // GPUS
    for e in range(EXPERTS):
        copies = [tuple(x) for x in np.argwhere(slot_expert == e)]  # (d, j) in rank order
        supply = {s: int(counts[s, e]) for s in range(RANKS)}
        capacity = {c: int(quota[c]) for c in copies}
        flows = {s: {c: 0 for c in copies} for s in range(RANKS)}
        if tiered:
            for s in range(RANKS):  # own rank
                fill(supply, capacity, flows, [s], [c for c in copies if c[0] == s])
            for n in range(RANKS // GPUS):  # own node
                sources = [s for s in range(RANKS) if node[s] == n]
                here = [c for c in copies if node[c[0]] == n]
                total = sum(capacity[c] for c in here)
                node_supply = sum(supply[s] for s in sources)
                kept = np.float32(min(node_supply, total))
                # Copies take shares of what the node keeps in proportion to their capacity...
                share = {c: min(capacity[c], int(np.floor(kept * np.float32(capacity[c]) / np.float32(max(total, 1)))))
                         for c in here}
                copy_end = dict(zip(here, np.cumsum([share[c] for c in here])))
                # ...and sources give them in proportion to their supply: source s gives the stretch
                # [floor(scale x supply before s), floor(scale x supply up to s)) of the line, at
                # most its supply, and each copy takes what lies in its own stretch.
                scale = np.float32(sum(share.values())) / np.float32(max(node_supply, 1))
                before = 0
                for s in sources:
                    lo = int(np.floor(scale * np.float32(before)))
                    hi = min(int(np.floor(scale * np.float32(before + supply[s]))), lo + supply[s])
                    before += supply[s]
                    for c in here:
                        moved = max(min(hi, copy_end[c]) - max(lo, copy_end[c] - share[c]), 0)
                        flows[s][c] += moved
                        supply[s] -= moved
                        capacity[c] -= moved
        fill(supply, capacity, flows, range(RANKS), copies)  # anywhere
        for s in range(RANKS):
            for (d, j), moved in flows[s].items():
                route[s, d, j] = moved
    return route


@pytest.mark.parametrize("tiered", [True, False])
def test_plan_from_quotas_matches_loop_reference(tiered):
    routed = jax.jit(lambda c, s, q: plan_from_quotas(c, s, q, GPUS, tiered))
    for seed in range(25):
        counts, slot_expert, quota, home = random_layout(seed)
        want = reference_route(counts, slot_expert, quota, tiered)
        on_device = routed(counts, slot_expert, quota)
        on_host = plan_from_quotas(counts, slot_expert, quota, GPUS, tiered, np)
        np.testing.assert_array_equal(np.asarray(on_device.route), want, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(on_host.route, want, err_msg=f"seed {seed}")
        check_plan(on_device, counts, np.arange(EXPERTS).reshape(RANKS, -1))
        # Given a list of experts that holds every guest's (a copy loop's candidates, here with
        # others mixed in, in random order), the transport lists those home slots instead: same plan.
        guests = np.unique(slot_expert[:, home:][slot_expert[:, home:] >= 0])
        extra = np.random.default_rng(seed).choice(EXPERTS, size=3, replace=False)
        experts = np.random.default_rng(seed + 1).permutation(np.union1d(guests, extra)).astype(np.int32)
        listed = plan_from_quotas(counts, slot_expert, quota, GPUS, tiered, np, experts=experts)
        np.testing.assert_array_equal(listed.route, want, err_msg=f"seed {seed}, experts listed")


def test_tiered_routing_feeds_copies_from_their_own_node_first():
    counts, slot_expert, quota, _ = random_layout(3)
    route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, True, np).route)
    oblivious = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, False, np).route)
    node = np.arange(RANKS) // GPUS
    crossing = lambda r: r[node[:, None] != node[None, :]].sum()  # noqa: E731
    assert crossing(route) <= crossing(oblivious)


def test_a_node_feeds_its_copy_from_every_source_in_proportion():
    # Expert 0 lives on rank 0 (node 0); node 1's sources hold all its pairs, 0, 20, 30 and 50 on
    # ranks 4-7, and its one copy, on rank 4, takes half of them. Each source keeps half of its own
    # pairs on the node and sends half across; in rank order rank 7 would send all 50 across.
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[4:, 0] = (0, 20, 30, 50)
    placement = np.arange(EXPERTS).reshape(RANKS, -1)
    guests = np.full((RANKS, GUESTS), -1)
    guests[4, 0] = 0
    slot_expert = np.concatenate([placement, guests], axis=1).astype(np.int32)
    quota = np.where(slot_expert == 0, 50, 0).astype(np.int32)
    home = placement.shape[1]
    for xp in (np, jnp):
        route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, True, xp).route)
        np.testing.assert_array_equal(route[4:, 4, home], (0, 10, 15, 25))
        np.testing.assert_array_equal(route[4:, 0, 0], (0, 10, 15, 25))


def test_spill_matches_sorted_definition():
    rng = np.random.default_rng(0)
    jitted = jax.jit(spill_per_expert)
    for _ in range(20):
        loads = rng.integers(0, 50, 32) * (rng.random(32) < 0.8)
        loads[rng.integers(0, 32, 4)] = 25  # ties
        placement = rng.permutation(32).reshape(8, 4)
        target = int(-(-loads.sum() // 8))
        want = np.zeros(32, np.int64)
        for r in range(8):
            excess = max(loads[placement[r]].sum() - target, 0)
            for e in sorted(placement[r], key=lambda e: (-loads[e], list(placement[r]).index(e))):
                want[e] = min(loads[e], excess)
                excess -= want[e]
        np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(loads), jnp.asarray(placement), target)), want)
        np.testing.assert_array_equal(spill_per_expert(loads, placement, target, np), want)


def test_node_pairs_are_shared_in_proportion_to_capacity():
    """Expert 0 lives on rank 0 and has a guest copy on rank 1, same node; ranks 2 and 3 (that node)
    send 15 pairs each, ranks 4-7 (the other node) 15 each. The home slot takes 60 and the guest 30:
    the node's 30 pairs split 20 / 10, so each copy takes two thirds of its pairs across nodes. In
    rank order the home would take all 30 and leave the guest nothing but remote pairs."""
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[2:, 0] = 15
    slot_expert = np.concatenate([np.arange(EXPERTS).reshape(RANKS, -1), np.full((RANKS, GUESTS), -1)], axis=1)
    slot_expert[1, 2] = 0
    quota = np.zeros_like(slot_expert)
    quota[0, 0], quota[1, 2] = 60, 30
    for route in (plan_from_quotas(counts, slot_expert, quota, GPUS, True, np).route,
                  np.asarray(jax.jit(lambda c, s, q: plan_from_quotas(c, s, q, GPUS, True).route)(counts, slot_expert, quota))):
        assert route[2:4, 0, 0].sum() == 20 and route[2:4, 1, 2].sum() == 10
        assert route[4:, 0, 0].sum() == 40 and route[4:, 1, 2].sum() == 20
