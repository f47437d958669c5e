import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from jtopoep.metrics import inter_bytes_floor, summarize
from jtopoep.plan import check_plan
from jtopoep.planners import eplb_host, get_planner
from jtopoep.topology import make_mesh

from planner_cases import DIMS, KINDS, R, TOPO, adversarial, jitted, loads

PLANNERS = ["none", "eplb", "topoep", "taot"]
SETTINGS = [(E, K) for E in (R, 8 * R) for K in (0, 1, 2)]


def imbalance(plan):
    loads_ = np.asarray(plan.route).sum((0, 2))
    return loads_.max() / max(loads_.mean(), 1e-9)


@pytest.mark.parametrize("num_experts,guest_slots", SETTINGS)
@settings(max_examples=200)
@given(load=loads)
def test_every_plan_is_valid(num_experts, guest_slots, load):
    counts = adversarial(load[0], num_experts, load[1], load[2])
    base = None
    for name in PLANNERS:
        k = 0 if name == "none" else guest_slots
        plan = jitted(name, num_experts, k)[1](counts)
        check_plan(plan, counts)
        if name == "none":
            base = imbalance(plan)
            home_loads = np.asarray(plan.route).sum((0, 2))
        elif name == "topoep":
            assert imbalance(plan) <= base + 1e-6, "topoep made the balance worse than no balancing"
        if name in ("topoep", "taot"):
            # Copies go only where there is room below T*, and take at most that room (over-shedding
            # included); home ranks only shed. So no rank ends above T* unless it started there, and
            # the routing's levelling raises ranks no higher than the busiest one
            # (test_levelling_keeps_the_busiest_rank checks it against the plan without).
            target = -(-counts.sum() // R)
            loads_ = np.asarray(plan.route).sum((0, 2))
            assert loads_.max() <= np.maximum(home_loads, target).max(), name


@settings(max_examples=40)
@given(load=loads)
def test_min_gain_plans_are_valid(load):
    counts = adversarial(load[0], 8 * R, load[1], load[2])
    for name in ("eplb", "topoep", "taot"):
        check_plan(jitted(name, 8 * R, 2, 1.0)[1](counts), counts)


@settings(max_examples=40)
@given(load=loads)
def test_no_plan_crosses_nodes_less_than_the_floor(load):
    """metrics.inter_bytes_floor bounds every planner's inter-node bytes from below, at the tests'
    small expert shapes where copies pay for themselves after a dozen pairs."""
    counts = adversarial(load[0], 8 * R, load[1], load[2])
    floor = inter_bytes_floor(counts, TOPO, DIMS, 2)
    for name in PLANNERS:
        plan = jitted(name, 8 * R, 0 if name == "none" else 2)[1](counts)
        assert summarize(plan, counts, TOPO, DIMS)["inter_bytes"] >= floor * (1 - 1e-12), name


@settings(max_examples=30)
@given(load=loads)
def test_eplb_host_matches_device(load):
    counts = adversarial(load[0], 8 * R, load[1], load[2])
    planner, device = jitted("eplb", 8 * R, 2)
    host = eplb_host(planner, counts)
    for a, b in zip(device(counts), host):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_unknown_planner_lists_names():
    with pytest.raises(ValueError, match=r"unknown planner 'greedy'; known planners: \['eplb', 'none', 'taot', 'topoep'\]"):
        get_planner("greedy", topology=TOPO, num_experts=16, guest_slots=1)


def test_planners_are_hashable_and_static():
    a = get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=2)
    b = get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="multiple of the 8 ranks"):
        get_planner("eplb", topology=TOPO, num_experts=12, guest_slots=1)
    with pytest.raises(ValueError, match="needs dims"):
        get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=1, min_gain=1.0)
    for knob in ("locality_weight", "weight_cost"):
        with pytest.raises(ValueError, match=f"{knob} = -1.0 must be >= 0"):
            get_planner("taot", topology=TOPO, num_experts=16, guest_slots=1, **{knob: -1.0})
    with pytest.raises(ValueError, match="exchange_credit = -0.5 must be >= 0"):
        get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=1, exchange_credit=-0.5)


def test_wrong_counts_shape():
    planner = get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=1)
    with pytest.raises(ValueError, match=r"counts has shape \(8, 32\); this planner expects \(8, 16\)"):
        planner(jnp.zeros((8, 32), jnp.int32))


@pytest.mark.parametrize("name", PLANNERS)
def test_plans_identical_on_every_device(devices, name):
    """Each device plans from the all-gathered counts; the gathered plans are bitwise equal."""
    mesh = make_mesh(TOPO)
    planner = jitted(name, 8 * R, 0 if name == "none" else 2)[0]
    local = jnp.asarray(adversarial("zipf", 8 * R, 300, 7))

    def body(c):
        counts = jax.lax.all_gather(c[0], ("node", "gpu"))
        plan = planner(counts)
        return jax.tree.map(lambda x: x[None], plan)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu"))))
    first = fn(local)
    second = fn(local)
    for leaf, again in zip(first, second):
        leaf = np.asarray(leaf)
        assert all(np.array_equal(leaf[0], leaf[r]) for r in range(R))
        assert np.array_equal(leaf, np.asarray(again))
    check_plan(jax.tree.map(lambda x: x[0], first), np.asarray(local).reshape(R, -1))


def test_topoep_reaches_lower_bound_on_a_hot_rank():
    """A hand case: rank 0's two experts take 120 pairs each, the rest 8; T* = ceil(sum / R)."""
    counts = np.ones((R, 16), np.int32)
    counts[:, 0] = 15
    counts[:, 1] = 15
    # Without expert dimensions copies are free: pure balancing reaches the bound.
    plan = get_planner("topoep", topology=TOPO, num_experts=16, guest_slots=2)(counts)
    check_plan(plan, counts)
    loads_ = np.asarray(plan.route).sum((0, 2))
    assert loads_.max() == -(-counts.sum() // R)
    summary = summarize(plan, counts, TOPO, DIMS)
    assert summary["imbalance"] == pytest.approx(summary["imbalance_lower_bound"])


@pytest.mark.parametrize("name", ["topoep", "taot"])
def test_room_behind_full_slots_is_reopened_on_a_home_rank(name):
    """One expert per rank, one guest slot: six experts take 14 pairs, two take 2; T* = 11. The
    six spills (3 each) fit in the two cold ranks' room (9 each), but those have two slots for six
    experts. A copy that leaves room behind its rank's last slot takes all of it (9, not 3), which
    opens room on the copied expert's home rank, whose own slot takes the next spill, and so on
    down the chain: every rank ends at T*, where copying only spill left four ranks at 14."""
    loads_ = np.array([14, 14, 14, 14, 14, 14, 2, 2])
    counts = np.zeros((R, 8), np.int32)
    for e, load in enumerate(loads_):
        for i in range(load):
            counts[(e + i) % R, e] += 1
    plan = get_planner(name, topology=TOPO, num_experts=8, guest_slots=1)(counts)
    check_plan(plan, counts)
    np.testing.assert_array_equal(np.asarray(plan.route).sum((0, 2)), 11)


@pytest.mark.parametrize("name", ["topoep", "taot"])
def test_copies_must_pay_for_exposed_transfers(name):
    """With real expert shapes, 120 pairs save ~nothing next to shipping a 3 x 4096 x 14336 expert:
    the cost model refuses every copy. With 100x the pairs the same hot rank is worth relieving."""
    from jtopoep.costmodel import ExpertDims
    big = ExpertDims(d_model=4096, expert_hidden=14336, bytes_per_element=2)
    counts = np.ones((R, 16), np.int32)
    counts[:, :2] = 15
    planner = get_planner(name, topology=TOPO, num_experts=16, guest_slots=2, dims=big)
    plan = planner(counts)
    check_plan(plan, counts)
    assert (np.asarray(plan.slot_expert)[:, 2:] == -1).all()
    heavy = counts * 100_000
    plan = planner(heavy)
    check_plan(plan, heavy)
    assert (np.asarray(plan.slot_expert)[:, 2:] >= 0).any()
    assert imbalance(plan) < imbalance(get_planner("none", topology=TOPO, num_experts=16, guest_slots=0)(heavy))


def test_loops_with_a_static_trip_count_give_the_same_plans(monkeypatch):
    """Off CPU the copy and swap loops run their full static trip count (no host round trip per
    step on GPU); a step after the work is done changes nothing, so the plans are the same."""
    from jtopoep.planners import loops

    monkeypatch.setattr(loops, "EARLY_EXIT_PLATFORMS", ())
    for name in ("topoep", "taot"):
        planner, early = jitted(name, 8 * R, 2)
        fixed = jax.jit(lambda c, p=planner: p(c))
        hlo = fixed.lower(adversarial("zipf", 8 * R, 500, 0)).compile().as_text()
        whiles = [line for line in hlo.splitlines() if " while(" in line]
        assert whiles and all("known_trip_count" in line for line in whiles), name
        for kind in KINDS:
            for seed in range(4):
                counts = adversarial(kind, 8 * R, 300 + 97 * seed, seed)
                for a, b in zip(early(counts), fixed(counts)):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), (name, kind, seed)


@functools.lru_cache(maxsize=None)
def unpriced_topoep():
    """topoep without expert shapes: every copy is free, so it makes them at the tests' tiny sizes."""
    return jax.jit(get_planner("topoep", topology=TOPO, num_experts=8 * R, guest_slots=2))


@settings(max_examples=40)
@given(load=loads)
def test_plans_given_held_copies_are_valid(load):
    """held (the guest experts each rank holds from the previous micro-batch): every plan stays
    valid, and topoep's (unpriced, so that it makes copies here) stays no worse than no balancing."""
    counts = adversarial(load[0], 8 * R, load[1], load[2])
    held = np.random.default_rng(load[2]).integers(-1, 8 * R, size=(R, 2)).astype(np.int32)
    for name in ("eplb", "topoep", "taot"):
        check_plan(jitted(name, 8 * R, 2)[1](counts, None, held), counts)
    told = unpriced_topoep()(counts, None, held)
    check_plan(told, counts)
    assert imbalance(told) <= imbalance(jitted("none", 8 * R, 0)[1](counts)) + 1e-6


def test_topoep_puts_a_copy_where_it_is_held_when_that_balances_as_well():
    """Expert 0 (rank 0) spills 40 pairs. Ranks 5 and 6 (node 1) have room for all of it, rank 5 one
    pair more, so topoep copies it onto rank 5; told that rank 6 holds expert 0, onto rank 6."""
    counts = np.full((R, 8 * R), 2, np.int32)
    counts[:, 0] = 6
    counts[:, 40:56] = 1  # the home experts of ranks 5 and 6
    counts[0, 48] = 2
    plain = unpriced_topoep()(counts)
    held = np.full((R, 2), -1, np.int32)
    held[6, 1] = 0
    told = unpriced_topoep()(counts, None, held)
    check_plan(told, counts)
    assert (np.asarray(told.slot_expert)[6, 8:] == 0).any() and not (np.asarray(plain.slot_expert)[6, 8:] == 0).any()
    assert imbalance(told) == imbalance(plain)
    with pytest.raises(ValueError, match=r"held has shape \(8, 3\)"):
        get_planner("topoep", topology=TOPO, num_experts=8 * R, guest_slots=2)(counts, None, np.full((R, 3), -1))


def test_exchange_saving_is_the_fall_of_the_largest_scale_out_receive():
    """Receives 5, 3, 2, 1 s (send floor 0.5): a copy off rank 0 (the largest) that takes 3 s off it
    and adds 1 s to rank 3 leaves rank 1's 3 s the largest, a saving of 2 s; onto rank 1 instead,
    rank 1 rises to 4 s, a saving of 1 s. Off rank 1 (not the largest) it saves nothing, and with a
    send floor of 4.5 s only the 0.5 s above it counts."""
    from jtopoep.planners.pricing import TransferClock, exchange_saving

    recv = jnp.asarray([5.0, 3.0, 2.0, 1.0])
    clock = TransferClock.start(jnp.zeros(4), recv, jnp.full(4, 0.5), 2)
    np.testing.assert_allclose(exchange_saving(clock, 0, None, 3.0, 1.0), [0.0, 1.0, 2.0, 2.0])
    assert float(exchange_saving(clock, 0, 3, 3.0, 1.0)) == 2.0
    assert float(exchange_saving(clock, 1, 3, 3.0, 1.0)) == 0.0
    floored = TransferClock.start(jnp.zeros(4), recv, jnp.full(4, 4.5), 2)
    assert float(exchange_saving(floored, 0, 3, 3.0, 1.0)) == 0.5
    # Per candidate and rank at once ([C, R], as taot prices them): the same figures.
    both = exchange_saving(clock, jnp.asarray([[0], [1]]), None, 3.0, 1.0)
    np.testing.assert_allclose(both, [[0.0, 1.0, 2.0, 2.0], [0.0] * 4])


def test_scale_out_shift_follows_locality_tiered_routing():
    """Expert homed on node 0 with 10, 20, 30, 40 uncovered pairs from nodes 0-3. A copy on node 1
    taking 50 pairs takes node 1's 20 first (they stop crossing to the home), then 30 from nodes 0,
    2 and 3 in proportion (10 : 30 : 40): all 30 cross to the copy, and all but node 0's eighth
    crossed to the home. On the home's node, the copy's pairs from other nodes simply move."""
    from jtopoep.planners.pricing import home_node_share, scale_out_shift

    share = home_node_share(jnp.asarray([10.0, 20.0, 30.0, 40.0]), 0)
    np.testing.assert_allclose(share, [0.0, 10 / 80, 10 / 70, 10 / 60], rtol=1e-6)
    drop, rise = scale_out_shift(50.0, 20.0, share[1], False)
    np.testing.assert_allclose([drop, rise], [20 + 30 * 7 / 8, 30], rtol=1e-6)
    drop, rise = scale_out_shift(50.0, 10.0, share[0], True)
    np.testing.assert_allclose([drop, rise], [40, 40], rtol=1e-6)


def test_tracked_scale_out_exchange_starts_as_the_cost_model_prices_the_home_plan():
    from jtopoep.costmodel import EXCHANGES_PER_LAYER, link_class
    from jtopoep.plan import home_plan
    from jtopoep.planners.pricing import home_exchange_seconds

    counts = adversarial("random", 2 * R, 50, 3)
    placement = np.arange(2 * R).reshape(R, 2)
    per_pair = EXCHANGES_PER_LAYER * DIMS.pair_bytes / TOPO.inter_bw
    recv, send = home_exchange_seconds(jnp.asarray(counts), jnp.asarray(placement), TOPO, per_pair)
    pairs = np.asarray(home_plan(jnp.asarray(counts), jnp.asarray(placement), 0).route).sum(2)
    across = np.where(link_class(TOPO) == 2, pairs, 0)
    np.testing.assert_allclose(recv, across.sum(0) * per_pair, rtol=1e-6)
    np.testing.assert_allclose(send, across.sum(1) * per_pair, rtol=1e-6)


@pytest.mark.parametrize("name", ["topoep", "taot"])
def test_levelling_keeps_the_busiest_rank(name):
    """The same copies with and without the routing's levelling (level_receive): without it, no rank
    ends above T* unless it started there, and none above where it started unless at or below T*;
    with it, no rank carries more than the busiest did without (the home of a hot expert can even
    carry less, where its copies had slack), each expert's pairs all land, and the largest
    scale-out receive is no larger on these loads."""
    from jtopoep.costmodel import link_class

    plain = jax.jit(get_planner(name, topology=TOPO, num_experts=8 * R, guest_slots=2, dims=DIMS,
                                level_receive=False))
    levelled = jitted(name, 8 * R, 2)[1]
    home = jitted("none", 8 * R, 0)[1]
    across = link_class(TOPO) == 2
    for kind in KINDS:
        counts = adversarial(kind, 8 * R, 200, 7)
        a, b = plain(counts), levelled(counts)
        check_plan(b, counts)
        np.testing.assert_array_equal(np.asarray(a.slot_expert), np.asarray(b.slot_expert))
        loads_a, loads_b = np.asarray(a.route).sum((0, 2)), np.asarray(b.route).sum((0, 2))
        target = -(-counts.sum() // R)
        assert (loads_a <= np.maximum(np.asarray(home(counts).route).sum((0, 2)), target)).all(), kind
        assert loads_b.max() <= loads_a.max(), kind
        receive = [np.where(across, np.asarray(p.route).sum(2), 0).sum(0).max() for p in (a, b)]
        assert receive[1] <= receive[0], kind


def test_the_clock_prices_copies_as_the_cost_model_charges_them():
    """Copies made one by one, each priced by copy_exposure before the clock takes it: the prices
    add up to the cost model's guest-weight term for all of them (whole copies, no GEMM moved), with
    NVLink and scale-out transfers running at once. And a hand case: a home that has sent two
    copies across nodes (2 s on its NIC, 2.2 s of GEMM to hide them) ships a third copy to its own
    node for free, where the sum of its transfers (2.5 s) would expose 0.3 s; across nodes the third
    copy exposes 0.8 s."""
    from jtopoep.costmodel import copy_seconds_per_rank, exposed_weight_seconds
    from jtopoep.planners.pricing import TransferClock, clock_after_copy, copy_exposure, transfer_costs

    link_s = np.asarray(transfer_costs(TOPO, DIMS)[0])
    rng = np.random.default_rng(0)
    hide = rng.uniform(0.0, 3.0, R).astype(np.float32) * link_s.max()
    clock = TransferClock.start(jnp.asarray(hide), jnp.zeros(R), jnp.zeros(R), TOPO.gpus_per_node)
    moves = np.zeros((R, R), np.int64)
    priced = 0.0
    for _ in range(30):
        home, dest = rng.choice(R, 2, replace=False)
        priced += float(copy_exposure(clock, home, dest, link_s[home, dest], 0.0))
        clock = clock_after_copy(clock, home, dest, link_s[home, dest], 0.0, True, 0.0, 0.0)
        moves[home, dest] += 1
    out = copy_seconds_per_rank(moves, TOPO, DIMS)
    assert priced > 0
    np.testing.assert_allclose(priced, exposed_weight_seconds(out, out, hide, np.zeros(R), 1), rtol=1e-5)

    gpus = TOPO.gpus_per_node
    clock = TransferClock.start(jnp.full(R, 2.2), jnp.zeros(R), jnp.zeros(R), gpus)
    for dest in (gpus, gpus + 1):
        clock = clock_after_copy(clock, 0, dest, 1.0, 0.0, True, 0.0, 0.0)
    assert float(copy_exposure(clock, 0, 1, 0.5, 0.0)) == 0.0
    np.testing.assert_allclose(float(copy_exposure(clock, 0, gpus + 2, 1.0, 0.0)), 0.8, rtol=1e-6)


@pytest.mark.parametrize("name", ["topoep", "taot"])
def test_a_copy_may_pay_for_its_weights_with_the_exchange_it_saves(name):
    """Expert 0 (rank 0, node 0) takes 1000 pairs from each rank of node 1, the rest 100: rank 0's
    scale-out receive binds the exchange. With narrow experts (F = 256) the GEMM time a copy saves
    does not pay for shipping it, so GEMM-only pricing (exchange_credit 0) makes none; counting a
    quarter of the exchange time a copy on node 1 saves, copies are made, and the cost model's layer
    time falls by about a fifth."""
    from jtopoep.costmodel import ExpertDims, layer_time

    dims = ExpertDims(d_model=2048, expert_hidden=256, bytes_per_element=2)
    counts = np.full((R, 16), 100, np.int32)
    counts[4:, 0] = 1000
    placement = np.arange(16).reshape(R, 2)
    times = {}
    for credit in (0.0, 0.25):
        plan = get_planner(name, topology=TOPO, num_experts=16, guest_slots=2, dims=dims,
                           exchange_credit=credit)(counts)
        check_plan(plan, counts)
        times[credit] = layer_time(plan, TOPO, dims, placement)["total_s"]
        copies = (np.asarray(plan.slot_expert)[:, 2:] >= 0).sum()
        assert (copies == 0) == (credit == 0), (credit, copies)
    assert times[0.25] < 0.9 * times[0.0]
