import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

from jtopoep import traces
from jtopoep.metrics import inter_bytes_floor, summarize
from jtopoep.plan import check_plan
from jtopoep.planners import eplb_host, get_planner
from jtopoep.topology import make_mesh

from conftest import FUSION_EMITTERS
from planner_cases import DIMS, KINDS, R, TOPO, adversarial, jitted, loads

PLANNERS = ["none", "eplb", "topoep", "taot"]
SETTINGS = [(E, K) for E in (R, 8 * R) for K in (0, 1, 2)]


def imbalance(plan):
    loads_ = np.asarray(plan.route).sum((0, 2))
    return loads_.max() / max(loads_.mean(), 1e-9)


@pytest.mark.parametrize("num_experts,guest_slots", SETTINGS)
@settings(max_examples=100)  # x 6 settings x 4 planners
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
            # and top-ups included); home ranks only shed. So no rank ends above T* unless it started
            # there.
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
    with pytest.raises(ValueError, match="epsilon = -1.0 must be > 0"):
        get_planner("taot", topology=TOPO, num_experts=16, guest_slots=1, epsilon=-1.0)


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


@functools.lru_cache(maxsize=None)
def unpriced_topoep():
    """topoep without expert shapes: every copy is free, so it makes them at the tests' tiny sizes."""
    return jax.jit(get_planner("topoep", topology=TOPO, num_experts=8 * R, guest_slots=2))


@settings(max_examples=40)
@given(load=loads)
def test_plans_are_valid_for_any_placement(load):
    """Homes need not be contiguous: for a random placement every plan keeps it in its home slots,
    conserves every source's pairs, and topoep (unpriced) balances no worse than no balancing."""
    counts = adversarial(load[0], 8 * R, load[1], load[2])
    placement = np.random.default_rng(load[2]).permutation(8 * R).reshape(R, 8).astype(np.int32)
    for name in PLANNERS:
        plan = jitted(name, 8 * R, 0 if name == "none" else 2)[1](counts, placement)
        check_plan(plan, counts, placement)
    spread = unpriced_topoep()(counts, placement)
    check_plan(spread, counts, placement)
    assert imbalance(spread) <= imbalance(jitted("none", 8 * R, 0)[1](counts, placement)) + 1e-6


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


def test_a_held_copy_pays_where_a_shipped_one_does_not():
    """A copy the rank holds from the step's previous micro-batch ships only its gradients. Expert
    0 sheds all its pairs to the seven other ranks in equal copies, sized so that the transfers
    cannot all hide behind the GEMMs the home keeps: of the same copies, more are made where the
    ranks hold the expert, and all of them where pricing is off."""
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners.problem import CopyProblem, Pricing, Shipped, paying_pieces

    dims = ExpertDims(d_model=1024, expert_hidden=4096, bytes_per_element=2)
    pricing = Pricing.make(TOPO, dims, 0.0, True)
    pairs = int(pricing.copy_s[1] / pricing.pair_s)  # one scale-out transfer's worth of GEMM time
    counts = np.zeros((R, 16), np.int32)
    counts[0, 0] = 7 * pairs
    problem = CopyProblem.build(jnp.asarray(counts), jnp.arange(16).reshape(R, 2), TOPO.gpus_per_node, 1)

    def made(held, priced=pricing):
        return int(np.asarray(paying_pieces(jnp.zeros(7, jnp.int32), jnp.arange(1, 8), jnp.full(7, pairs),
                                            jnp.ones(7, bool), jnp.full(7, held), problem, Shipped.none(R, 16, 2),
                                            priced, TOPO.gpus_per_node)[0]).sum())

    assert made(False) < made(True) <= 7 and made(False, None) == 7


def test_a_homes_copies_are_made_largest_first_while_they_pay():
    """Copies of one home's experts are decided together: the largest first, each against what it
    adds to the exposed transfer time once the larger ones are made; one that does not pay ends the
    home's list."""
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners.problem import CopyProblem, Pricing, Shipped, paying_pieces

    dims = ExpertDims(d_model=1024, expert_hidden=4096, bytes_per_element=2)
    pricing = Pricing.make(TOPO, dims, 0.0, True)
    big = int(4 * pricing.copy_s[0] / pricing.pair_s)
    counts = np.zeros((R, 16), np.int32)
    amount = jnp.array([big // 100, big, big // 2])
    counts[0, 0] = int(amount.sum())  # the home sheds everything: no GEMM of its own left to hide behind
    problem = CopyProblem.build(jnp.asarray(counts), jnp.arange(16).reshape(R, 2), TOPO.gpus_per_node, 1)
    made = paying_pieces(jnp.zeros(3, jnp.int32), jnp.arange(1, 4), amount, jnp.ones(3, bool), jnp.zeros(3, bool),
                         problem, Shipped.none(R, 16, 2), pricing, TOPO.gpus_per_node)[0]
    # The largest saves four transfers' worth and exposes less than one; the second would expose
    # both transfers in full for two transfers' worth; the smallest comes after it.
    assert list(np.asarray(made)) == [False, True, False]
    unpriced = paying_pieces(jnp.zeros(3, jnp.int32), jnp.arange(1, 4), amount, jnp.ones(3, bool),
                             jnp.zeros(3, bool), problem, Shipped.none(R, 16, 2), None, TOPO.gpus_per_node)[0]
    assert np.asarray(unpriced).all()


def test_the_transfers_paying_pieces_gives_are_those_of_the_copies_it_makes():
    """ship adds the transfers paying_pieces returns: at every home they sum to the transfers of
    the made copies counted afresh (the crossing copy of each (expert, node) may be another one)."""
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners.problem import CopyProblem, Pricing, Shipped, _home_transfers, paying_pieces

    rng = np.random.default_rng(3)
    pricing = Pricing.make(TOPO, ExpertDims(d_model=1024, expert_hidden=4096, bytes_per_element=2), 0.0, True)
    decided = []
    for _ in range(5):
        counts = rng.integers(0, 400, (R, 16)).astype(np.int32)  # little GEMM to hide transfers behind
        problem = CopyProblem.build(jnp.asarray(counts), jnp.arange(16).reshape(R, 2), TOPO.gpus_per_node, 1)
        num = 24
        expert, dest = jnp.asarray(rng.integers(0, 16, num)), jnp.asarray(rng.integers(0, R, num))
        amount = jnp.asarray(rng.integers(0, 3000, num) * (rng.random(num) < 0.8))
        new, held = jnp.asarray(rng.random(num) < 0.7), jnp.asarray(rng.random(num) < 0.2)
        shipped = Shipped.none(R, 16, R // TOPO.gpus_per_node)
        made, kinds = paying_pieces(expert, dest, amount, new, held, problem, shipped, pricing, TOPO.gpus_per_node)
        decided.append(np.asarray(made)[np.asarray(amount) > 0])
        home = problem.home_rank[expert]
        afresh = _home_transfers(expert, dest, jnp.where(made, amount, 0), new & made, held, problem, shipped,
                                 TOPO.gpus_per_node)
        np.testing.assert_array_equal(np.asarray(jnp.zeros((R, 4), jnp.int32).at[home].add(kinds)),
                                      np.asarray(jnp.zeros((R, 4), jnp.int32).at[home].add(afresh)))
    decided = np.concatenate(decided)
    assert decided.any() and not decided.all()  # copies made and copies refused


@pytest.mark.parametrize("compared_bins", [16, 0])
def test_match_lays_sorted_items_against_sorted_bins(compared_bins, monkeypatch):
    """rounds.match against its definition: per row, the row's items and bins largest first (ties to
    the lower id, bins to the lower column) laid end to end; each bin gets the first `width` items
    its interval overlaps. Bins placed by comparing them all, and (compared_bins 0) by a sort."""
    from jtopoep.planners import rounds
    from jtopoep.planners.rounds import match

    monkeypatch.setattr(rounds, "_COMPARED_BINS", compared_bins)
    rng = np.random.default_rng(0)
    jitted_match = jax.jit(match, static_argnums=(3,))
    for trial in range(40):
        num_rows, per_row, bins, width = (int(x) for x in (rng.integers(1, 4), rng.integers(1, 6), rng.integers(1, 6),
                                                           rng.integers(1, 4)))
        ids = num_rows * per_row
        size = rng.integers(0, 20, ids) * (rng.random(ids) < 0.8)
        if trial % 3 == 0 and ids > 1:  # two sizes past ordering's key range (2**31 // ids): they tie, by id
            size[rng.choice(ids, 2, replace=False)] = (10 ** 9, 10 ** 9 + 7)
        tied = np.minimum(size, 2 ** 31 // ids - 1)
        rows = rng.permutation(ids).reshape(num_rows, per_row)
        bin_size = rng.integers(0, 20, (num_rows, bins)) * (rng.random((num_rows, bins)) < 0.8)
        got_item, got_amount = (np.asarray(x) for x in jitted_match(
            jnp.asarray(size, jnp.int32), jnp.asarray(rows, jnp.int32), jnp.asarray(bin_size, jnp.int32), width))
        assert got_item.shape == got_amount.shape == (num_rows, bins, width)
        for r in range(num_rows):
            mine = sorted((i for i in rows[r] if size[i]), key=lambda i: (-tied[i], i))
            others = sorted((c for c in range(bins) if bin_size[r, c]), key=lambda c: (-bin_size[r, c], c))
            for b in range(bins):
                want = []
                if bin_size[r, b]:
                    lo = sum(bin_size[r, c] for c in others[:others.index(b)])
                    hi, start = lo + bin_size[r, b], 0
                    for i in mine:
                        cut = min(hi, start + size[i]) - max(lo, start)
                        if cut > 0:
                            want.append((int(i), int(cut)))
                        start += size[i]
                got = [(int(i), int(a)) for i, a in zip(got_item[r, b], got_amount[r, b]) if a > 0]
                assert got == want[:width], (trial, r, b)


def test_pair_off_gives_the_jth_largest_bin_the_jth_largest_item():
    """rounds.pair_off against its definition: per row, items and bins largest first (ties to the
    lower id, bins to the lower column); the j-th bin takes min(its size, the j-th item's), 0 past
    the last item."""
    from jtopoep.planners.rounds import pair_off

    rng = np.random.default_rng(1)
    jitted_pair_off = jax.jit(pair_off)
    for trial in range(40):
        num_rows, per_row, bins = (int(x) for x in (rng.integers(1, 4), rng.integers(1, 6), rng.integers(1, 6)))
        ids = num_rows * per_row
        size = rng.integers(0, 20, ids) * (rng.random(ids) < 0.8)
        rows = rng.permutation(ids).reshape(num_rows, per_row)
        bin_size = rng.integers(0, 20, (num_rows, bins)) * (rng.random((num_rows, bins)) < 0.8)
        got_item, got_amount = (np.asarray(x)[:, :, 0] for x in jitted_pair_off(
            jnp.asarray(size, jnp.int32), jnp.asarray(rows, jnp.int32), jnp.asarray(bin_size, jnp.int32)))
        for r in range(num_rows):
            items = sorted(rows[r], key=lambda i: (-size[i], i))
            for place, b in enumerate(sorted(range(bins), key=lambda c: (-bin_size[r, c], c))):
                want = min(size[items[place]], bin_size[r, b]) if place < per_row else 0
                assert got_amount[r, b] == want, (trial, r, b)
                if want:
                    assert got_item[r, b] == items[place], (trial, r, b)


@pytest.mark.parametrize("name", ["topoep", "taot"])
@pytest.mark.parametrize("num_experts,guest_slots", [(16, 1), (32, 2)])
def test_a_hot_nodes_spill_reaches_the_bound_when_guest_slots_are_scarce(name, num_experts, guest_slots):
    """Node 0's experts take four times the pairs of node 1's: its ranks' spill needs nearly every
    guest slot on node 1. Laid end to end, the spill's pieces would outnumber those slots (slivers
    at the ranks' edges take slots); one piece a rank a round places the spill: every plan within 3%
    of T*."""
    planner = jax.jit(get_planner(name, topology=TOPO, num_experts=num_experts, guest_slots=guest_slots))
    popularity = np.ones(num_experts)
    popularity[: num_experts // 2] *= 4.0
    for seed in range(12):
        counts = np.asarray(traces.sample_counts(popularity, R, 64, 2, np.random.default_rng(seed)))
        plan = planner(counts)
        check_plan(plan, counts)
        assert np.asarray(plan.route).sum((0, 2)).max() <= 1.03 * -(-counts.sum() // R), seed


@pytest.mark.parametrize("name", ["topoep", "taot"])
def test_no_compiled_planner_loop_runs_more_than_64_steps(name, monkeypatch):
    """The planners are a fixed number of parallel rounds: at any R, compiled as for a GPU (no
    early exit), the program's loops (the rounds, Sinkhorn's iterations) have known trip counts of
    at most 64, and none is a data-dependent while loop."""
    from jtopoep.config import TopologyConfig
    from jtopoep.planners import rounds

    monkeypatch.setattr(rounds, "EARLY_EXIT_PLATFORMS", ())
    for num_ranks in (8, 256):
        topology = TopologyConfig(num_nodes=num_ranks // 8, gpus_per_node=8).to_topology()
        planner = get_planner(name, topology=topology, num_experts=max(256, num_ranks), guest_slots=2, dims=DIMS)
        counts = jnp.ones((num_ranks, max(256, num_ranks)), jnp.int32)
        hlo = jax.jit(planner).lower(counts).compile(FUSION_EMITTERS).as_text()
        whiles = [line for line in hlo.splitlines() if " while(" in line]
        for line in whiles:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            assert trips and int(trips.group(1)) <= 64, (name, num_ranks, line[:200])


def test_a_home_pays_one_scale_out_transfer_per_node_it_reaches():
    """Under the fan-out fetch, expert 0's copies on ranks 4-7 (node 1) cost its home one transfer
    across nodes (the relay passes the rest on), which its other expert's GEMMs hide: all four are
    made, where four transfers from home would expose three."""
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners.problem import CopyProblem, Pricing, Shipped, _home_transfers, paying_pieces

    dims = ExpertDims(d_model=1024, expert_hidden=4096, bytes_per_element=2)
    pricing = Pricing.make(TOPO, dims, 0.0, True)
    pairs = int(1.2 * pricing.copy_s[1] / pricing.pair_s)  # a little more GEMM time than one crossing
    counts = np.zeros((R, 16), np.int32)
    counts[0, 0] = 4 * pairs
    counts[0, 1] = int(pricing.copy_s[1] / pricing.pair_fwd_s) + 1  # forward GEMMs that hide one transfer
    problem = CopyProblem.build(jnp.asarray(counts), jnp.arange(16).reshape(R, 2), TOPO.gpus_per_node, 1)
    args = (jnp.zeros(4, jnp.int32), jnp.arange(4, 8), jnp.full(4, pairs), jnp.ones(4, bool), jnp.zeros(4, bool),
            problem, Shipped.none(R, 16, 2))
    kinds = np.asarray(_home_transfers(*args, TOPO.gpus_per_node))
    np.testing.assert_array_equal(kinds.sum(0), [0, 1, 0, 1])
    made, shipped_kinds = paying_pieces(*args, pricing, TOPO.gpus_per_node)
    assert np.asarray(made).all()
    np.testing.assert_array_equal(np.asarray(shipped_kinds).sum(0), [0, 1, 0, 1])  # what ship adds


def test_pricing_counts_a_homes_crossings_past_its_share_as_nvlink_hand_offs():
    """The fetch spreads a node's crossings over its G links (plan.guest_fetch): a home with three
    crossings on a node of 4 GPUs with one more elsewhere (share ceil(4 / 4) = 1) sends one across
    and hands two to peers over NVLink; with 7 elsewhere (share 3) it sends all three itself."""
    from jtopoep.planners.problem import _node_others, _over_links

    copies = jnp.asarray([[0, 3, 1, 3]], jnp.int32)  # weights NVLink, across; gradients NVLink, across
    for elsewhere, expected in ((1, [2, 1, 3, 1]), (7, [0, 3, 1, 3])):
        made = jnp.zeros((8, 4), jnp.int32).at[0].set(copies[0]).at[2, 1].set(elsewhere).at[2, 3].set(elsewhere)
        others = _node_others(made, jnp.asarray([0]), 4)
        np.testing.assert_array_equal(np.asarray(others), [[elsewhere, elsewhere]])
        np.testing.assert_array_equal(np.asarray(_over_links(copies, others, 4))[0], expected)


def test_rounds_that_stop_early_give_the_same_plans(monkeypatch):
    """On CPU the rounds stop once no spill is left; a round after that changes nothing, so the
    plans equal those of the full static count that GPUs run."""
    from jtopoep.planners import rounds

    early = {name: jitted(name, 8 * R, 2)[1] for name in ("topoep", "taot")}
    monkeypatch.setattr(rounds, "EARLY_EXIT_PLATFORMS", ())
    for name, planner in early.items():
        fixed = jax.jit(lambda c, p=jitted(name, 8 * R, 2)[0]: p(c))
        for kind in KINDS:
            for seed in range(3):
                counts = adversarial(kind, 8 * R, 300 + 97 * seed, seed)
                for a, b in zip(planner(counts), fixed(counts)):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), (name, kind, seed)


def test_the_pairwise_forms_gpus_run_give_the_same_plans(monkeypatch):
    """Where proposals are few, GPUs decide which pay, and share out each home's pairs, from an
    [n, n] comparison of which proposal comes first (arrays.pairwise_or_sorted); XLA:CPU sorts them.
    Both give topoep the same plans (its demand, within-node and across-node rounds all price and
    share; taot's use the same code), pricing on (at a real expert's size, where it refuses copies;
    with and without held copies) and off."""
    name = "topoep"
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners import arrays

    real = ExpertDims(d_model=2048, expert_hidden=1408, bytes_per_element=2)
    planners = [get_planner(name, topology=TOPO, num_experts=8 * R, guest_slots=2, dims=real, price_transfers=priced)
                for priced in (True, False)]
    rng = np.random.default_rng(5)
    cases = [(adversarial(kind, 8 * R, 300 + 97 * seed, seed), held)
             for kind in KINDS for seed in range(2) for held in (None, rng.integers(-1, 8 * R, (R, 2)))]

    def plans():
        out = []
        for planner in planners:
            quotas = jax.jit(lambda c, h, p=planner: p.quotas(c, None, h))
            out += [[np.asarray(x) for x in quotas(jnp.asarray(c), None if h is None else jnp.asarray(h, jnp.int32))]
                    for c, h in cases]
        return out

    sorted_plans = plans()
    monkeypatch.setattr(arrays, "SORTED_ORDER_PLATFORMS", ())
    for a, b in zip(sorted_plans, plans(), strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])

def test_the_first_copies_go_to_the_nodes_whose_sources_send_the_spilled_pairs():
    """Expert 0 (home rank 0, node 0) spills; node 2's sources send it pairs and node 1's none, and
    both have room: the demand round proposes its copies on node 2 only, up to what node 2 sends,
    one a rank."""
    from jtopoep.planners.problem import CopyProblem
    from jtopoep.planners.rounds import Copies, onto_demand

    gpus = 2
    counts = np.ones((6, 6), np.int32)
    counts[4:, 0] = 30
    counts[2:4, 0] = 0
    placement = jnp.arange(6, dtype=jnp.int32).reshape(6, 1)
    problem = CopyProblem.build(jnp.asarray(counts), placement, gpus, 2)
    copies = Copies.start(problem, 2, gpus)
    expert, amount = map(np.asarray, onto_demand(copies, problem, placement, gpus, least=1, width=1))
    rank_node = np.arange(6) // gpus
    proposed = amount * (expert == 0)
    assert proposed[rank_node == 1].sum() == 0 and proposed[rank_node == 2].sum() > 0
    assert proposed.sum() <= int(problem.node_loads[2, 0]) and (proposed > 0).sum(1).max() == 1
    room = np.asarray(copies.room(problem, placement))
    assert (proposed.sum(1) <= room).all()


@pytest.mark.parametrize("name,s", [("topoep", 1.0), ("topoep", 1.2), ("taot", 1.0)])
def test_copies_where_the_pairs_come_from_cut_inter_node_bytes_at_the_same_balance(name, s, monkeypatch):
    """Zipf loads on 4 nodes x 8 GPUs, K = 2: with its first copies on the nodes the spilled pairs
    come from, each planner moves fewer inter-node bytes (tokens and weights) than without that
    round, and still balances to the bound."""
    from jtopoep.config import TopologyConfig
    from jtopoep.costmodel import ExpertDims
    from jtopoep.planners.base import CopyingPlanner

    topology = TopologyConfig(num_nodes=4, gpus_per_node=8).to_topology()
    dims = ExpertDims(d_model=2048, expert_hidden=1408, bytes_per_element=2)
    planner = get_planner(name, topology=topology, num_experts=256, guest_slots=2, dims=dims)
    mats = traces.zipf(32, 256, 4096, 8, s, steps=3, drift=8, seed=1)

    def run():  # a new function each time, so jit traces the planner afresh
        plan = jax.jit(lambda counts: planner(counts))
        return [summarize(jax.device_get(plan(jnp.asarray(c))), c, topology, dims) for c in mats]

    with_round = run()
    monkeypatch.setattr(CopyingPlanner, "_where_pairs_come_from", lambda self, problem, placement, copies, _: copies)
    without = run()
    for a, b in zip(with_round, without):
        assert a["imbalance"] <= a["imbalance_lower_bound"] * 1.001
        assert a["inter_bytes"] < b["inter_bytes"], (a["inter_bytes"], b["inter_bytes"])


def test_match_pairs_gives_match_pieces_at_the_chosen_bins():
    """rounds.match_pairs equals rounds.match at each chosen (row, bin), bins past ordering's key
    range included (they order as match orders them)."""
    from jtopoep.planners.rounds import match, match_pairs

    # Two bins past the key range (2**31 // 4), the smaller one in the lower column: match ties them
    # by column, so it comes first.
    big = 2 ** 31 // 4
    args = (jnp.asarray([2 ** 30, 5], jnp.int32), jnp.asarray([[0, 1]], jnp.int32),
            jnp.asarray([[big + 5, big + 50, 3, 0]], jnp.int32), 2)
    pairs = jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(match_pairs(*args, *pairs)[1]), np.asarray(match(*args)[1])[0])
    rng = np.random.default_rng(1)
    for trial in range(30):
        num_rows, per_row, bins, width = (int(x) for x in (rng.integers(1, 5), rng.integers(1, 6), rng.integers(1, 24),
                                                           rng.integers(1, 4)))
        ids = num_rows * per_row
        size = rng.integers(0, 20, ids) * (rng.random(ids) < 0.8)
        rows = rng.permutation(ids).reshape(num_rows, per_row)
        bin_size = rng.integers(0, 20, (num_rows, bins)) * (rng.random((num_rows, bins)) < 0.8)
        if trial % 3 == 0:  # bins past the key range (2**31 // bins): they tie, by column
            chosen = rng.choice(bins, min(2, bins), replace=False)
            bin_size[0, chosen] = (2 ** 31 // bin_size.size + np.array([5, 50]))[:len(chosen)]
            size[rows[0, 0]] = 2 ** 30
        pairs = np.divmod(rng.permutation(num_rows * bins)[:max(1, num_rows * bins * 2 // 3)], bins)
        args = (jnp.asarray(size, jnp.int32), jnp.asarray(rows, jnp.int32), jnp.asarray(bin_size, jnp.int32), width)
        whole_item, whole_amount = (np.asarray(x) for x in match(*args))
        item, amount = (np.asarray(x) for x in match_pairs(*args, *(jnp.asarray(p, jnp.int32) for p in pairs)))
        np.testing.assert_array_equal(amount, whole_amount[pairs])
        live = amount > 0
        np.testing.assert_array_equal(item[live], whole_item[pairs][live])
