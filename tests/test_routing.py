"""Locality-tiered routing and spill attribution against plain loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.costmodel import exchange_seconds_per_rank
from jtopoep.plan import Plan, check_plan, home_plan
from jtopoep.planners.arrays import proportional_floor
from jtopoep.planners.problem import spill_per_expert
from jtopoep.planners.routing import plan_from_quotas
from routing_oracle import best_routing, eplb_plan_on_zipf

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
    """plan_from_quotas by its definition, one expert at a time: with tiers, each node keeps
    min(its sources' pairs, its slots' quotas), given by its sources in rank order and taken by its
    slots in proportion to their quotas (rounded down at each slot's end); then the rest, sources and
    slots in rank order."""
    route = np.zeros((RANKS, RANKS, slot_expert.shape[1]), np.int64)
    node = np.arange(RANKS) // GPUS
    for e in range(EXPERTS):
        slots = [tuple(x) for x in np.argwhere(slot_expert == e)]  # (d, j) in rank order
        supply = {s: int(counts[s, e]) for s in range(RANKS)}
        capacity = {c: int(quota[c]) for c in slots}
        flows = {s: {c: 0 for c in slots} for s in range(RANKS)}
        if tiered:
            for n in range(RANKS // GPUS):
                sources = [s for s in range(RANKS) if node[s] == n]
                mine = [c for c in slots if node[c[0]] == n]
                kept = min(sum(supply[s] for s in sources), sum(capacity[c] for c in mine))
                give, take = {}, {}
                left = kept
                for s in sources:
                    give[s] = min(supply[s], left)
                    left -= give[s]
                room, before = sum(capacity[c] for c in mine), 0
                for c in mine:  # the slots' shares of what the node keeps, in proportion to quota
                    take[c] = (kept * (before + capacity[c])) // room - (kept * before) // room
                    before += capacity[c]
                fill(give, take, flows, sources, mine)
                for s in sources:
                    supply[s] = int(counts[s, e]) - sum(flows[s][c] for c in mine)
                for c in mine:
                    capacity[c] = int(quota[c]) - sum(flows[s][c] for s in sources)
        fill(supply, capacity, flows, range(RANKS), slots)
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
        np.testing.assert_array_equal(np.asarray(on_device.route).sum(0), np.where(slot_expert >= 0, quota, 0))


def loop_cuts(route, recv_rows, relay_rows, gpus):
    """What survives when each destination keeps its first recv_rows pairs in (source, slot) order,
    then each relay (n, g) its first relay_rows in (source node, destination gpu, slot) order (None:
    no relay cut)."""
    kept = route.copy()
    num_ranks = route.shape[0]
    for d in range(num_ranks):
        room = recv_rows
        for s in range(num_ranks):
            for j in range(route.shape[2]):
                kept[s, d, j] = min(kept[s, d, j], room)
                room -= kept[s, d, j]
    if relay_rows is None:
        return kept
    for n in range(num_ranks // gpus):
        for g in range(gpus):
            room = relay_rows
            for s in range(g, num_ranks, gpus):
                for d in range(n * gpus, (n + 1) * gpus):
                    for j in range(route.shape[2]):
                        kept[s, d, j] = min(kept[s, d, j], room)
                        room -= kept[s, d, j]
    return kept


@pytest.mark.parametrize("tiered", [True, False])
def test_each_rank_derives_its_row_and_its_nodes_columns_of_the_route(devices, tiered):
    """rank_route inside shard_map, on 2 nodes x 4 GPUs: each rank's row and its node's columns equal
    the whole route's (plan_from_quotas), uncut and cut to receive buffers and relays as the loop
    cuts them, and every rank reports the same dropped and crossing totals."""
    from jax.sharding import PartitionSpec as P

    from jtopoep.planners.routing import SlotQuotas
    from jtopoep.rank_route import rank_route
    from jtopoep.topology import Topology, make_mesh

    mesh = make_mesh(Topology.preset("cpu-2x4"))
    node_of = np.arange(RANKS) // GPUS
    for seed in range(4):
        counts, slot_expert, quota, _ = random_layout(seed)
        route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, tiered, np).route)
        busiest = int(route.sum((0, 2)).max())
        for recv_rows, relay_rows in ((None, None), (busiest - 7, None), (busiest - 3, busiest // 2)):
            def body(c, se, q, recv_rows=recv_rows, relay_rows=relay_rows):
                node, gpu = jax.lax.axis_index("node"), jax.lax.axis_index("gpu")
                got = rank_route(c, SlotQuotas(se, q), tiered, node, gpu, GPUS, recv_rows=recv_rows,
                                 relay_rows=relay_rows)
                return jax.tree.map(lambda a: a[None], (got.sent, got.received(gpu), got.node_columns, got.dropped,
                                                        got.crossing, got.planned_crossing))

            spec = P(("node", "gpu"))
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 3, out_specs=(spec,) * 6))
            sent, received, columns, dropped, crossing, planned = (np.asarray(a) for a in fn(counts, slot_expert, quota))
            kept = loop_cuts(route, recv_rows or 10**9, relay_rows, GPUS)
            across = node_of[:, None] != node_of[None, :]
            for r in range(RANKS):
                np.testing.assert_array_equal(sent[r], kept[r], err_msg=f"seed {seed}, row {r}")
                np.testing.assert_array_equal(received[r], kept[:, r], err_msg=f"seed {seed}, column {r}")
                n = node_of[r]
                np.testing.assert_array_equal(columns[r], kept[:, n * GPUS:(n + 1) * GPUS])
            np.testing.assert_array_equal(dropped, route.sum() - kept.sum())
            np.testing.assert_array_equal(crossing, kept.sum(2)[across].sum())
            np.testing.assert_array_equal(planned, route.sum(2)[across].sum())
        assert recv_rows is not None and route.sum() > kept.sum(), "the cut cases must drop pairs"


def test_tiered_routing_feeds_copies_from_their_own_node_first():
    """Nodes of two ranks. Expert 0 (home rank 0, keeping nothing) has copies on ranks 2 and 6
    taking 10 pairs each; ranks 0 and 3 send 10 each. In rank order rank 0 fills rank 2's copy and
    rank 3's pairs cross to rank 6: 20 pairs cross nodes. With tiers rank 3 feeds its own node's
    copy first, and only rank 0's 10 cross."""
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[0, 0] = counts[3, 0] = 10
    slot_expert = np.concatenate([np.arange(EXPERTS).reshape(RANKS, -1), np.full((RANKS, 1), -1)], 1)
    slot_expert[2, 2] = slot_expert[6, 2] = 0
    quota = np.zeros_like(slot_expert)
    quota[2, 2] = quota[6, 2] = 10
    node = np.arange(RANKS) // 2
    for tiered, crossing in ((False, 20), (True, 10)):
        route = np.asarray(plan_from_quotas(counts, slot_expert, quota, 2, tiered, np).route)
        assert route[node[:, None] != node[None, :]].sum() == crossing
        assert route[3, 2, 2] == (10 if tiered else 0)
    for seed in range(10):  # never more crossing than the oblivious split
        counts, slot_expert, quota, _ = random_layout(seed)
        tiers = np.asarray(plan_from_quotas(counts, slot_expert, quota, 2, True, np).route)
        oblivious = np.asarray(plan_from_quotas(counts, slot_expert, quota, 2, False, np).route)
        assert tiers[node[:, None] != node[None, :]].sum() <= oblivious[node[:, None] != node[None, :]].sum()


def test_spill_matches_sorted_definition():
    rng = np.random.default_rng(0)
    jitted = jax.jit(spill_per_expert)
    for case in range(40):
        loads = rng.integers(0, 50, 32) * (rng.random(32) < 0.8)
        loads[rng.integers(0, 32, 4)] = 25  # ties
        placement = rng.permutation(32).reshape(8, 4)
        target = int(-(-loads.sum() // 8))
        # Half the cases hold back some pairs of each expert until its rank's others have shed.
        last = rng.integers(0, 60, 32) if case % 2 else None
        want = np.zeros(32, np.int64)
        for r in range(8):
            excess = max(loads[placement[r]].sum() - target, 0)
            order = sorted(placement[r], key=lambda e: (-loads[e], list(placement[r]).index(e)))
            held = {e: 0 if last is None else min(last[e], loads[e]) for e in order}
            for part in (lambda e: loads[e] - held[e], lambda e: held[e]):  # the rest first, then the held
                for e in order:
                    shed = min(part(e), excess)
                    want[e] += shed
                    excess -= shed
        got = jitted(jnp.asarray(loads), jnp.asarray(placement), target,
                     shed_last=None if last is None else jnp.asarray(last))
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(spill_per_expert(loads, placement, target, np, shed_last=last), want)


def test_best_routing_keeps_the_plans_copies_and_quotas_and_is_never_slower():
    """The linear program's routing of an eplb plan (topology-oblivious routing, many copies) keeps
    every slot's quota and every source's pairs of every expert, prices as it says, and is faster
    than the plan's; with no copies there is nothing to choose."""
    topology, dims, counts, placement, plan = eplb_plan_on_zipf()
    slot_expert = np.asarray(plan.slot_expert)
    seconds, route = best_routing(plan, counts, topology, dims)
    np.testing.assert_allclose(route.sum(0), np.asarray(plan.route).sum(0), atol=1e-6)
    per_expert = np.zeros_like(counts, np.float64)
    for e in range(32):
        per_expert[:, e] = route[:, slot_expert == e].sum(1)
    np.testing.assert_allclose(per_expert, counts, atol=1e-6)
    assert (route > -1e-9).all()
    priced = exchange_seconds_per_rank(Plan(slot_expert, route), topology, dims).max()
    np.testing.assert_allclose(priced, seconds, rtol=1e-6)
    assert seconds < exchange_seconds_per_rank(plan, topology, dims).max()
    alone = Plan(*map(np.asarray, home_plan(jnp.asarray(counts), jnp.asarray(placement), 2)))
    assert best_routing(alone, counts, topology, dims)[0] == exchange_seconds_per_rank(alone, topology, dims).max()




def test_proportional_floor_is_exact_past_the_int32_product():
    """floor(share * x / whole) against Python's integers, with products far past 2^31, at the
    ends (x = 0, x = whole, share = whole) and for an empty whole (0)."""
    rng = np.random.default_rng(0)
    whole = np.concatenate([rng.integers(1, 2**31 - 1, 300), rng.integers(1, 1000, 100), [2**31 - 1, 1, 0]])
    share = (rng.random(whole.size) * (whole + 1)).astype(np.int64)
    x = (rng.random(whole.size) * (whole + 1)).astype(np.int64)
    share[:20], x[20:40] = whole[:20], whole[20:40]
    x[40:50] = 0
    share, x = np.minimum(share, whole), np.minimum(x, whole)
    want = [int(a) * int(b) // int(c) if c else 0 for a, b, c in zip(share, x, whole)]
    args = [v.astype(np.int32) for v in (share, x, whole)]
    np.testing.assert_array_equal(np.asarray(jax.jit(proportional_floor)(*args)), want)
    np.testing.assert_array_equal(proportional_floor(*args, xp=np), want)
