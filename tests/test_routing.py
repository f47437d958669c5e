"""Locality-tiered routing and spill attribution against plain loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.costmodel import exchange_seconds_per_rank
from jtopoep.plan import Plan, check_plan, home_plan
from jtopoep.planners.common import spill_per_expert
from jtopoep.planners import routing
from jtopoep.planners.routing import BALANCE_ROUNDS, LEVEL_ROUNDS, plan_from_quotas, top_up, water_fill
from jtopoep.planners.swaps import scale_out_receive
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


def reference_water_fill(height, room, total):
    """routing.water_fill for one group of members, in Python integers and scalar float32."""
    f32 = np.float32
    def filled(level):
        return sum(min(max(h - level, 0), r) for h, r in zip(height, room))
    breaks = list(height) + [h - r for h, r in zip(height, room)]
    lo = max(b for b in breaks if filled(b) >= total)
    above = [b for b in breaks if filled(b) < total]
    level = f32(lo)
    if above:
        hi = min(above)
        step = f32(hi - lo) / f32(max(filled(lo) - filled(hi), 1))
        level = f32(lo) + f32(filled(lo) - total) * step
    return [int(np.floor(min(max(f32(h) - level, f32(0)), f32(r)))) for h, r in zip(height, room)]


def reference_top_up(amount, room, total):
    amount = list(amount)
    short = total - sum(amount)
    for i in range(len(amount)):
        if short > 0 and amount[i] < room[i]:
            amount[i] += 1
            short -= 1
    return amount


def reference_fixed_receive(counts, slot_expert):
    """[d] pairs each rank receives across nodes for its home experts without guest copies."""
    home = EXPERTS // RANKS
    node = np.arange(RANKS) // GPUS
    moved = {int(e) for e in slot_expert[:, home:].reshape(-1) if e >= 0}
    return [sum(int(counts[:, e].sum() - counts[node == node[d], e].sum()) for e in slot_expert[d, :home]
                if e not in moved) for d in range(RANKS)]


def reference_level(cross, counts, slot_expert, quota):
    """routing.level_receive with loops: cross {(d, j): pairs the copy takes from other nodes} for
    the copies of experts with guests, re-divided per expert among its first LEVEL_MEMBERS copies
    in rank order."""
    fixed = reference_fixed_receive(counts, slot_expert)
    load = [int(quota[d].sum()) for d in range(RANKS)]
    top = max(load)
    experts = sorted({int(slot_expert[c]) for c in cross})
    members = {e: sorted(c for c in cross if slot_expert[c] == e)[:routing.LEVEL_MEMBERS] for e in experts}
    copies = [max(sum(1 for c in cross if c[0] == d), 1) for d in range(RANKS)]
    for _ in range(LEVEL_ROUNDS):
        receive = [fixed[d] + sum(v for c, v in cross.items() if c[0] == d) for d in range(RANKS)]
        new = dict(cross)
        for e in experts:
            cs = members[e]
            depth = [cross[c] - receive[c[0]] for c in cs]
            room = [cross[c] + (top - load[c[0]]) // copies[c[0]] for c in cs]
            total = sum(cross[c] for c in cs)
            amounts = reference_top_up(reference_water_fill(depth, room, total), room, total)
            new.update(zip(cs, amounts))
        for c, v in new.items():
            load[c[0]] += v - cross[c]
        cross = new
    return cross


def reference_node_shares(counts, slot_expert, quota, rounds):
    """routing.node_shares with loops: ({(d, j): pairs the copy takes from its node},
    {(s, e): pairs the source gives to its node's copies of e}) for experts with guests."""
    home = EXPERTS // RANKS
    node = np.arange(RANKS) // GPUS
    loads = counts.sum(0)
    moved = sorted({int(e) for e in slot_expert[:, home:].reshape(-1) if e >= 0})
    home_node = {int(slot_expert[d, j]): node[d] for d in range(RANKS) for j in range(home)}
    members = {(n, e): list(range(n * GPUS, (n + 1) * GPUS)) for n in range(RANKS // GPUS) for e in moved}
    copy_on = {(d, e): j for d in range(RANKS) for j, e in enumerate(slot_expert[d]) if e in moved}
    room = {(d, e): int(quota[d, copy_on[(d, e)]]) if (d, e) in copy_on else 0 for d in range(RANKS) for e in moved}
    supply = {(s, e): int(counts[s, e]) for s in range(RANKS) for e in moved}
    kept = {g: min(sum(supply[(s, g[1])] for s in ranks), sum(room[(d, g[1])] for d in ranks))
            for g, ranks in members.items()}
    fixed_receive = reference_fixed_receive(counts, slot_expert)
    fixed_send = [sum(int(counts[s, e]) for e in range(EXPERTS) if e not in moved and home_node[e] != node[s])
                  for s in range(RANKS)]

    def proportional(weight):
        out = {}
        for (n, e), ranks in members.items():
            whole = np.float32(max(sum(weight[(r, e)] for r in ranks), 1))
            share = [int(np.floor(np.float32(kept[(n, e)]) * np.float32(weight[(r, e)]) / whole)) for r in ranks]
            out.update(zip([(r, e) for r in ranks], reference_top_up(share, [weight[(r, e)] for r in ranks],
                                                                      kept[(n, e)])))
        return out

    take, give = proportional(room), proportional(supply)
    for _ in range(rounds):
        receive = [fixed_receive[d] + sum(room[(d, e)] - take[(d, e)] for e in moved) for d in range(RANKS)]
        send = [fixed_send[s] + sum(supply[(s, e)] - give[(s, e)] for e in moved) for s in range(RANKS)]
        new_take, new_give = {}, {}
        for (n, e), ranks in members.items():
            keys = [(r, e) for r in ranks]
            amounts = reference_water_fill([receive[r] + take[k] for r, k in zip(ranks, keys)],
                                           [room[k] for k in keys], kept[(n, e)])
            new_take.update(zip(keys, reference_top_up(amounts, [room[k] for k in keys], kept[(n, e)])))
            filled = reference_water_fill([send[r] + give[k] for r, k in zip(ranks, keys)],
                                          [supply[k] for k in keys], kept[(n, e)])
            halfway = [(give[k] + f) // 2 for k, f in zip(keys, filled)]
            new_give.update(zip(keys, reference_top_up(halfway, [supply[k] for k in keys], kept[(n, e)])))
        take, give = new_take, new_give
    return {(d, j): take[(d, e)] for (d, e), j in copy_on.items()}, give


def reference_route(counts, slot_expert, quota, tiered, level=False):
    """[s, d, j] pairs, with explicit loops: each expert's node tier, then (level) the re-division of
    what copies take from other nodes, then each expert's anywhere tier."""
    route = np.zeros((RANKS,) + slot_expert.shape, np.int64)
    node = np.arange(RANKS) // GPUS
    if tiered:
        take, give = reference_node_shares(counts, slot_expert, quota, BALANCE_ROUNDS)
    tiers = {}
    for e in range(EXPERTS):
        copies = [tuple(x) for x in np.argwhere(slot_expert == e)]  # (d, j) in rank order
        supply = {s: int(counts[s, e]) for s in range(RANKS)}
        capacity = {c: int(quota[c]) for c in copies}
        flows = {s: {c: 0 for c in copies} for s in range(RANKS)}
        tiers[e] = copies, supply, capacity, flows
        if tiered and len(copies) > 1:
            for n in range(RANKS // GPUS):  # own node: the shares node_shares chose
                sources = [s for s in range(RANKS) if node[s] == n]
                here = [c for c in copies if node[c[0]] == n]
                rest_take = {c: take[c] for c in here}
                rest_give = {s: give[(s, e)] for s in sources}
                for c in here:  # a copy takes its own rank's pairs first
                    own = min(rest_take[c], rest_give[c[0]])
                    rest_take[c] -= own
                    rest_give[c[0]] -= own
                    flows[c[0]][c] += own
                    supply[c[0]] -= own
                    capacity[c] -= own
                for s in sources:  # then sources in rank order fill copies in rank order
                    for c in here:
                        moved = min(rest_give[s], rest_take[c])
                        rest_give[s] -= moved
                        rest_take[c] -= moved
                        flows[s][c] += moved
                        supply[s] -= moved
                        capacity[c] -= moved
    if tiered and level:
        cross = {c: tiers[e][2][c] for e in range(EXPERTS) if len(tiers[e][0]) > 1 for c in tiers[e][0]}
        for c, v in reference_level(cross, counts, slot_expert, quota).items():
            tiers[int(slot_expert[c])][2][c] = v
    for e, (copies, supply, capacity, flows) in tiers.items():
        fill(supply, capacity, flows, range(RANKS), copies)  # anywhere
        for s in range(RANKS):
            for (d, j), moved in flows[s].items():
                route[s, d, j] = moved
    return route


@pytest.mark.parametrize("tiered,level", [(True, False), (True, True), (False, False)])
def test_plan_from_quotas_matches_loop_reference(tiered, level):
    routed = jax.jit(lambda c, s, q: plan_from_quotas(c, s, q, GPUS, tiered, level=level))
    for seed in range(25):
        counts, slot_expert, quota, home = random_layout(seed)
        want = reference_route(counts, slot_expert, quota, tiered, level)
        on_device = routed(counts, slot_expert, quota)
        on_host = plan_from_quotas(counts, slot_expert, quota, GPUS, tiered, np, level=level)
        np.testing.assert_array_equal(np.asarray(on_device.route), want, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(on_host.route, want, err_msg=f"seed {seed}")
        check_plan(on_device, counts, np.arange(EXPERTS).reshape(RANKS, -1))
        # Given a list of experts that holds every guest's (a copy loop's candidates, here with
        # others mixed in, in random order), the transport lists those home slots instead: same plan.
        guests = np.unique(slot_expert[:, home:][slot_expert[:, home:] >= 0])
        extra = np.random.default_rng(seed).choice(EXPERTS, size=3, replace=False)
        experts = np.random.default_rng(seed + 1).permutation(np.union1d(guests, extra)).astype(np.int32)
        listed = plan_from_quotas(counts, slot_expert, quota, GPUS, tiered, np, experts=experts, level=level)
        np.testing.assert_array_equal(listed.route, want, err_msg=f"seed {seed}, experts listed")
        if level:  # no rank's load rises above the busiest rank's
            assert np.asarray(on_device.route).sum((0, 2)).max() <= quota.sum(1).max()


def test_levelling_only_the_first_copies_matches_loop_reference(monkeypatch):
    """With LEVEL_MEMBERS below an expert's copies, only its first copies in rank order share its
    pairs from other nodes; the rest keep theirs."""
    monkeypatch.setattr(routing, "LEVEL_MEMBERS", 2)
    routed = jax.jit(lambda c, s, q: plan_from_quotas(c, s, q, GPUS, True, level=True))
    capped = 0
    for seed in range(10):
        counts, slot_expert, quota, _ = random_layout(seed)
        want = reference_route(counts, slot_expert, quota, True, True)
        np.testing.assert_array_equal(np.asarray(routed(counts, slot_expert, quota).route), want)
        np.testing.assert_array_equal(plan_from_quotas(counts, slot_expert, quota, GPUS, True, np, level=True).route,
                                      want)
        capped += (np.bincount(slot_expert[slot_expert >= 0]) > 2).any()
    assert capped  # some expert had more copies than were levelled


def test_tiered_routing_feeds_copies_from_their_own_node_first():
    counts, slot_expert, quota, _ = random_layout(3)
    route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, True, np).route)
    oblivious = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, False, np).route)
    node = np.arange(RANKS) // GPUS
    crossing = lambda r: r[node[:, None] != node[None, :]].sum()  # noqa: E731
    assert crossing(route) <= crossing(oblivious)


def test_a_node_keeps_most_from_the_sources_that_would_send_most_across():
    # Expert 0 lives on rank 0 (node 0); node 1's sources hold all its pairs, 0, 20, 30 and 50 on
    # ranks 4-7, and its one copy, on rank 4, takes half of them. Each source sends across nodes
    # what it does not give the copy. Given in proportion, (0, 10, 15, 25), rank 7 would send 25
    # across; the level every source sends the same is 16.7, at gives (0, 3.3, 13.3, 33.3). Two
    # rounds of moving halfway there from the proportion (topped up to the 50 the node keeps):
    # (0, 7, 14, 29), then (0, 6, 13, 31). The largest send across nodes falls from 25 to 19.
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[4:, 0] = (0, 20, 30, 50)
    placement = np.arange(EXPERTS).reshape(RANKS, -1)
    guests = np.full((RANKS, GUESTS), -1)
    guests[4, 0] = 0
    slot_expert = np.concatenate([placement, guests], axis=1).astype(np.int32)
    quota = np.where(slot_expert == 0, 50, 0).astype(np.int32)
    home = placement.shape[1]
    assert BALANCE_ROUNDS == 2
    for xp in (np, jnp):
        route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, True, xp).route)
        np.testing.assert_array_equal(route[4:, 4, home], (0, 6, 13, 31))
        np.testing.assert_array_equal(route[4:, 0, 0], (0, 14, 17, 19))


def test_water_fill_levels_what_the_members_are_left_with():
    # Along axis 1, three members; each column of the last axis is its own group.
    height = np.array([[[10, 9, 9, 7], [4, 9, 9, 7], [0, 0, 0, 7]]])
    room = np.array([[[5, 10, 10, 3], [5, 10, 10, 3], [5, 10, 10, 3]]])
    total = np.array([[8, 5, 0, 9]])
    # 8 from (10, 4, 0): level 1, amounts (5, 3, 0), capped by the first member's room of 5.
    # 5 from (9, 9, 0): level 6.5, amounts (2.5, 2.5, 0), floored; top_up gives the first the 1 short.
    # Nothing to share; and everything, which fills every room.
    floored = np.array([[[5, 2, 0, 3], [3, 2, 0, 3], [0, 0, 0, 3]]])
    for xp in (np, jnp):
        got = water_fill(xp.asarray(height), xp.asarray(room), xp.asarray(total), xp)
        np.testing.assert_array_equal(np.asarray(got), floored)
        np.testing.assert_array_equal(np.asarray(top_up(got, xp.asarray(room), xp.asarray(total), xp)),
                                      floored + np.array([[[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]))
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = int(rng.integers(1, 6))
        height = rng.integers(0, 100, g)
        room = rng.integers(0, 40, g) * (rng.random(g) < 0.8)
        total = int(rng.integers(0, room.sum() + 1))
        got = water_fill(height[None, :, None], room[None, :, None], np.array([[total]]), np)
        assert list(got[0, :, 0]) == reference_water_fill(list(height), list(room), total)
        assert 0 <= total - got.sum() < g and (got >= 0).all() and (got[0, :, 0] <= room).all()
        full = top_up(got, room[None, :, None], np.array([[total]]), np)[0, :, 0]
        assert full.sum() == total and (full <= room).all()


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


def test_node_pairs_go_to_the_copy_that_would_receive_most_across_nodes():
    """Expert 0 lives on rank 0 and has a guest copy on rank 1, same node; ranks 2 and 3 (that node)
    send 15 pairs each, ranks 4-7 (the other node) 15 each. The home slot takes 60 and the guest 30.
    In proportion to their quotas the node's 30 pairs would split 20 / 10, and rank 0 would receive
    40 across nodes to rank 1's 20; given all 30, rank 0 receives 30 across, as rank 1 does."""
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[2:, 0] = 15
    slot_expert = np.concatenate([np.arange(EXPERTS).reshape(RANKS, -1), np.full((RANKS, GUESTS), -1)], axis=1)
    slot_expert[1, 2] = 0
    quota = np.zeros_like(slot_expert)
    quota[0, 0], quota[1, 2] = 60, 30
    for route in (plan_from_quotas(counts, slot_expert, quota, GPUS, True, np).route,
                  np.asarray(jax.jit(lambda c, s, q: plan_from_quotas(c, s, q, GPUS, True).route)(counts, slot_expert, quota))):
        assert route[2:4, 0, 0].sum() == 30 and route[2:4, 1, 2].sum() == 0
        assert route[4:, 0, 0].sum() == 30 and route[4:, 1, 2].sum() == 30


def test_levelling_shares_an_experts_pairs_from_other_nodes_by_the_ranks_receive():
    """Expert 0 lives on rank 0 with a guest copy on rank 1 (node 0); all its 160 pairs come from
    node 1, the home slot taking 120 and the guest 40. Rank 1 also receives expert 2's 20 pairs
    from node 1. As quoted, rank 0 receives 120 across nodes and rank 1 60. Levelled, the two
    receive 90 each (home 90, guest 70), and neither rank's load rises above the 120 the busiest
    had."""
    counts = np.zeros((RANKS, EXPERTS), np.int32)
    counts[4:, 0], counts[4:, 2] = 40, 5
    slot_expert = np.concatenate([np.arange(EXPERTS).reshape(RANKS, -1), np.full((RANKS, GUESTS), -1)], axis=1)
    slot_expert[1, 2] = 0
    quota = np.zeros_like(slot_expert)
    quota[0, 0], quota[1, 2], quota[1, 0] = 120, 40, 20
    node = np.arange(RANKS) // GPUS
    with pytest.raises(ValueError, match="needs tiered=True"):
        plan_from_quotas(counts, slot_expert, quota, GPUS, False, np, level=True)
    for level, home, guest in ((False, 120, 40), (True, 90, 70)):
        for xp in (np, jnp):
            route = np.asarray(plan_from_quotas(counts, slot_expert, quota, GPUS, True, xp, level=level).route)
            assert route[:, 0, 0].sum() == home and route[:, 1, 2].sum() == guest
            across = np.where(node[:, None] != node[None, :], route.sum(2), 0).sum(0)
            assert (across[0], across[1]) == (home, guest + 20)
            assert route.sum((0, 2)).max() <= 120


def test_scale_out_receive_estimate():
    """With no copies the estimate is exact: each rank receives across nodes its home experts' pairs
    from other nodes. A copy on another node, fed by that node's own pairs, takes them off the home's
    receive, and a copy that takes more than its node has receives the rest from other nodes."""
    rng = np.random.default_rng(3)
    num_ranks, gpus, home = 8, 4, 2
    counts = jnp.asarray(rng.integers(0, 50, (num_ranks, num_ranks * home)), jnp.int32)
    placement = jnp.arange(num_ranks * home, dtype=jnp.int32).reshape(num_ranks, home)
    none = jnp.full((num_ranks, 1), -1, jnp.int32)
    plan = plan_from_quotas(counts, placement, counts.sum(0)[placement], gpus, False)
    node = np.arange(num_ranks) // gpus
    across = np.where(node[:, None] != node[None, :], np.asarray(plan.route).sum(2), 0).sum(0)
    np.testing.assert_array_equal(scale_out_receive(counts, placement, none, jnp.zeros_like(none), gpus), across)
    # Expert 0 (home rank 0, node 0) copied onto rank 4 (node 1), taking exactly node 1's pairs of it.
    node1 = int(counts[gpus:, 0].sum())
    guests, quotas = none.at[4, 0].set(0), jnp.zeros_like(none).at[4, 0].set(node1)
    with_copy = np.asarray(scale_out_receive(counts, placement, guests, quotas, gpus))
    assert with_copy[0] == across[0] - node1 and with_copy[4] == across[4]
    # Taking 10 more than node 1 has: those 10 come from node 0 to rank 4.
    more = np.asarray(scale_out_receive(counts, placement, guests, quotas.at[4, 0].add(10), gpus))
    assert more[4] == across[4] + 10 and more[0] == across[0] - node1


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


def test_leveled_node_shares_come_close_to_the_linear_programs_exchange(monkeypatch):
    """eplb's copies and quotas on a skewed load, routed by locality tiers: levelling what each node
    keeps (routing.node_shares) brings the exchange within 1% of the fastest routing a linear
    program finds for the same slots and quotas; the shares it starts from, in proportion to the
    copies' quotas and the sources' pairs, are 10% or more above it (17% here)."""
    from jtopoep.planners import routing

    topology, dims, counts, placement, plan = eplb_plan_on_zipf()
    slot_expert, quota = np.asarray(plan.slot_expert), np.asarray(plan.route).sum(0)
    best, _ = best_routing(plan, counts, topology, dims)

    def exchange():
        routed = plan_from_quotas(counts, slot_expert, quota, topology.gpus_per_node, True, np)
        check_plan(routed, counts, placement)
        return exchange_seconds_per_rank(routed, topology, dims).max()

    assert exchange() <= 1.01 * best
    monkeypatch.setattr(routing, "BALANCE_ROUNDS", 0)
    assert exchange() >= 1.1 * best
