"""Metrics and cost model against hand computations."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jtopoep.costmodel import (ExpertDims, copy_break_even_pairs, exposed_weight_seconds, fetch_latency_seconds,
                                layer_time, relay_exchange_seconds_per_rank)
from jtopoep.metrics import counts_imbalance, imbalance, inter_node_pairs, summarize
from jtopoep.plan import Plan, contiguous_placement, home_plan
from jtopoep.topology import Topology

TOPO = Topology(num_nodes=2, gpus_per_node=2, intra_bw=100e9, inter_bw=25e9, intra_latency=1e-6,
                inter_latency=5e-6, flops=1e15, mfu=0.5)
DIMS = ExpertDims(d_model=1000, expert_hidden=2000, bytes_per_element=2)
PLACEMENT = np.arange(8).reshape(4, 2)


def plan_of(counts, guest_slots=0):
    return home_plan(jnp.asarray(counts), contiguous_placement(4, 8), guest_slots)


def test_summarize_home_plan_on_zipf():
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 9) ** 1.0
    counts = rng.multinomial(1000, p / p.sum(), size=4).astype(np.int32)
    s = summarize(plan_of(counts), counts, TOPO, DIMS)
    loads = counts.sum(0).reshape(4, 2).sum(1)  # experts 2r, 2r+1 live on rank r
    assert s["imbalance"] == pytest.approx(loads.max() / loads.mean())
    assert s["imbalance"] == s["imbalance_before"]
    assert s["imbalance_lower_bound"] == pytest.approx(np.ceil(4000 / 4) / 1000)
    nodes = loads.reshape(2, 2).sum(1)
    assert s["node_imbalance"] == pytest.approx(nodes.max() / nodes.mean())
    # pairs by link class: source s to expert e on rank e // 2
    local = sum(counts[r, 2 * r:2 * r + 2].sum() for r in range(4))
    inter = sum(counts[r, e] for r in range(4) for e in range(8) if r // 2 != e // 4)
    assert s["local_pairs"] == local and s["inter_pairs"] == inter
    assert s["intra_pairs"] == 4000 - local - inter
    assert s["inter_token_bytes"] == inter * 1000 * 2 * 4
    assert s["wcc"] == pytest.approx((s["intra_pairs"] * 1 + inter * 4.0) * 1000 * 2 * 4)
    assert s["guest_copies"] == 0 and s["wcc_weights"] == 0
    assert float(imbalance(plan_of(counts))) == pytest.approx(s["imbalance"], rel=1e-6)
    assert float(counts_imbalance(jnp.asarray(counts), jnp.asarray(PLACEMENT))) == pytest.approx(s["imbalance"], rel=1e-6)
    assert int(inter_node_pairs(plan_of(counts), 2)) == inter


def test_guest_weight_traffic():
    counts = np.zeros((4, 8), np.int32)
    counts[:, 0] = 10
    plan = plan_of(counts, guest_slots=1)
    slot_expert = np.array(plan.slot_expert)
    route = np.array(plan.route)
    slot_expert[3, 2] = 0  # a copy of expert 0 (home rank 0, node 0) on rank 3 (node 1)
    route[3, 0, 0], route[3, 3, 2] = 0, 10  # rank 3's own pairs stay on rank 3
    s = summarize(Plan(slot_expert, route), counts, TOPO, DIMS)
    assert s["inter_guest_copies"] == 1 and s["inter_weight_bytes"] == 2 * 3 * 1000 * 2000 * 2
    assert s["inter_pairs"] == 10  # rank 2's pairs still cross to rank 0


def test_break_even():
    intra, inter = copy_break_even_pairs(TOPO, DIMS)
    per_pair = 18 * 1000 * 2000 / (1e15 * 0.5)
    assert intra == pytest.approx(2 * 3 * 1000 * 2000 * 2 / 100e9 / per_pair)
    assert inter == pytest.approx(4 * intra)


def test_cost_model_balanced_load():
    """Every rank sends 10 pairs to every other rank and keeps 10: balanced, both link classes."""
    counts = np.full((4, 8), 5, np.int32)
    t = layer_time(plan_of(counts), TOPO, DIMS, PLACEMENT)
    gemm = 40 * 18 * 1000 * 2000 / 5e14
    assert t["gemm_s"] == pytest.approx(gemm)
    # per rank: 10 pairs to its node peer (intra), 20 to the other node (inter), each way
    per_rank = max(10 * 2000 / 100e9, 20 * 2000 / 25e9)
    assert t["exchange_s"] == pytest.approx(4 * (per_rank + 5e-6))
    assert t["weights_s"] == 0
    assert t["total_s"] == pytest.approx(gemm + t["exchange_s"])


def test_cost_model_one_hot_rank():
    """All pairs go to rank 0's expert 0; sources on node 1 send across nodes."""
    counts = np.zeros((4, 8), np.int32)
    counts[:, 0] = [7, 7, 7, 7]
    t = layer_time(plan_of(counts), TOPO, DIMS, PLACEMENT)
    assert t["gemm_s"] == pytest.approx(28 * 18 * 1000 * 2000 / 5e14)
    # rank 0 receives 7 intra (rank 1) and 14 inter (ranks 2, 3)
    assert t["exchange_s"] == pytest.approx(4 * (max(7 * 2000 / 100e9, 14 * 2000 / 25e9) + 5e-6))


def test_cost_model_all_inter_node_and_exposed_weights():
    """Rank 2 (node 1) sends all its pairs to rank 0 (node 0); a guest copy with nothing to hide behind."""
    counts = np.zeros((4, 8), np.int32)
    counts[2, 0] = 100
    plan = plan_of(counts, guest_slots=1)
    slot_expert = np.array(plan.slot_expert)
    slot_expert[3, 2] = 0  # an (idle) copy of expert 0 on rank 3: its weights cost time, exposed
    t = layer_time(Plan(slot_expert, np.array(plan.route)), TOPO, DIMS, PLACEMENT, planning_s=1e-4)
    assert t["exchange_s"] == pytest.approx(4 * (100 * 2000 / 25e9 + 5e-6))
    weight = 3 * 1000 * 2000 * 2 / 25e9
    fetch = 3 * 1e-6 + 5e-6  # the fetch's four exchanges: three over NVLink, then the crossings across nodes
    # Rank 3 has no home work to hide the weights (forward) or the gradients (backward) behind.
    assert t["weights_s"] == pytest.approx(weight + fetch + weight + fetch)
    assert t["planning_s"] == 1e-4
    assert t["total_s"] == pytest.approx(t["gemm_s"] + t["exchange_s"] + t["weights_s"] + 1e-4)
    # Rank 3 held that copy from the step's previous micro-batch: only its gradients travel.
    held = np.array([[-1], [-1], [-1], [0]])
    kept = layer_time(Plan(slot_expert, np.array(plan.route)), TOPO, DIMS, PLACEMENT, held=held)
    assert kept["weights_s"] == pytest.approx(weight + fetch)
    # A held expert on another rank, or another expert held, saves nothing.
    for other in ([[0], [-1], [-1], [-1]], [[-1], [-1], [-1], [1]]):
        t_other = layer_time(Plan(slot_expert, np.array(plan.route)), TOPO, DIMS, PLACEMENT, held=np.array(other))
        assert t_other["weights_s"] == pytest.approx(weight + fetch + weight + fetch)


def test_weights_in_slices_hide_behind_the_slices_already_there():
    """One rank: home GEMMs 1 s, guest GEMMs 2 s, 3 s of weights out and of gradients back.
    Whole copy: 3 - 1 = 2 s exposed forward, 3 - 2 x 1 = 1 s backward. In two slices: home 0-1,
    slice 0 lands at 1.5 and runs 1.5-2.5, slice 1 lands at 3 and runs 3-4, 1 s later than 3;
    backward: guest slices 0-2 and 2-4, their gradients on the link 2-3.5 and 4-5.5, before the home
    backward ends at 6: nothing exposed."""
    one = [np.array([v]) for v in (3.0, 3.0, 1.0, 2.0)]
    assert exposed_weight_seconds(*one, chunks=1) == pytest.approx(2.0 + 1.0)
    assert exposed_weight_seconds(*one, chunks=2) == pytest.approx(1.0)
    # A rank with no guest GEMM (a home rank sending) gains nothing from slices.
    sender = [np.array([v]) for v in (3.0, 3.0, 1.0, 0.0)]
    assert exposed_weight_seconds(*sender, chunks=4) == exposed_weight_seconds(*sender, chunks=1) == 2.0 + 1.0
    # Finer slices never expose more (most exposed rank of each direction, over 16 ranks).
    rng = np.random.default_rng(0)
    for _ in range(20):
        parts = [rng.uniform(0, 4, 16) for _ in range(4)]
        times = [exposed_weight_seconds(*parts, chunks=n) for n in (1, 2, 4, 8)]
        assert all(a >= b - 1e-12 for a, b in zip(times, times[1:])) and times[-1] >= 0


def test_slice_exposure_is_the_timeline_of_its_docstring():
    """The closed form against the timeline simulated slice by slice, per rank: forward, slice j lands
    at (j + 1) out / n and its GEMM (g / n) starts once it has landed and the previous one is done,
    after the home GEMMs; backward, the guest slices' backward (2 g / n each) runs first, and each
    slice's gradients (back / n) go out when it is done and the link is free, before the home
    backward (2 home) ends or late."""
    rng = np.random.default_rng(1)
    for chunks in (1, 2, 3, 5):
        out, back, home, guest = (rng.uniform(0, 3, 12) for _ in range(4))
        t = home.copy()
        link = np.zeros(12)
        for j in range(chunks):
            t = np.maximum(t, (j + 1) * out / chunks) + guest / chunks
            link = np.maximum(link, (j + 1) * 2 * guest / chunks) + back / chunks
        forward = np.maximum(t - home - guest, 0).max()
        backward = np.maximum(link - 2 * guest - 2 * home, 0).max()
        assert exposed_weight_seconds(out, back, home, guest, chunks) == pytest.approx(forward + backward, abs=1e-12)


def test_each_slice_pays_the_fetch_latency():
    """One rank, home GEMMs 0.5 s, guest GEMMs 0.4 s, 2 s of weights out and of gradients back, in two
    slices whose exchanges take 0.1 s each way. Forward: slice 0 lands at 1 + 0.1 and runs to 1.3,
    slice 1 lands at 2 + 0.2 and runs to 2.4, 1.5 s after home and guest GEMMs would end (1.3 without
    the latency). Backward: the guest slices' backward ends at 0.4 and 0.8, their gradients land at
    0.4 + 1.1 and 1.5 + 1.1, 0.8 s after the home backward (1.8; 0.6 without)."""
    one = [np.array([v]) for v in (2.0, 2.0, 0.5, 0.4)]
    assert exposed_weight_seconds(*one, chunks=2, slice_latency=0.1) == pytest.approx(1.5 + 0.8)
    assert exposed_weight_seconds(*one, chunks=2) == pytest.approx(1.3 + 0.6)
    idle = [np.array([v]) for v in (0.0, 0.0, 1.0, 0.0)]
    assert exposed_weight_seconds(*idle, chunks=4, slice_latency=0.1) == 0.0
    # Past some count, finer slices expose more: each pays the latency again.
    many = [exposed_weight_seconds(*one, chunks=n, slice_latency=0.1) for n in (1, 2, 4, 8)]
    assert many[-1] > min(many)


def test_fetch_latency_is_its_exchanges_at_the_slowest_link_each_uses():
    counts = np.zeros((4, 8), np.int32)
    plan = plan_of(counts, guest_slots=1)
    slot_expert = np.array(plan.slot_expert)
    assert fetch_latency_seconds(Plan(slot_expert, np.array(plan.route)), TOPO, PLACEMENT) == 0.0
    slot_expert[1, 2] = 0  # expert 0 (rank 0) on rank 1, its node: four exchanges, NVLink only
    assert fetch_latency_seconds(Plan(slot_expert, np.array(plan.route)), TOPO, PLACEMENT) == pytest.approx(4 * 1e-6)
    slot_expert[3, 2] = 0  # and on rank 3, across nodes: the crossings pay the scale-out latency
    assert fetch_latency_seconds(Plan(slot_expert, np.array(plan.route)), TOPO, PLACEMENT) == pytest.approx(
        3 * 1e-6 + 5e-6)
    # One node: no hand-offs and no crossings, two exchanges.
    one_node = dataclasses.replace(TOPO, num_nodes=1, gpus_per_node=4)
    slot_expert[3, 2] = -1
    assert fetch_latency_seconds(Plan(slot_expert, np.array(plan.route)), one_node, PLACEMENT) == pytest.approx(2e-6)


def test_layer_time_prices_the_slices_of_its_dims():
    """A guest copy on rank 1 (expert 0's home node) that takes half of expert 0's pairs: in slices,
    its weights partly hide behind its own guest GEMMs; nothing else changes. Where the guest GEMMs
    are too short to hide anything, slices only add the fetch's latency."""
    for pairs, finer_is_faster in ((60_000, True), (60, False)):
        counts = np.zeros((4, 8), np.int32)
        counts[0, 0], counts[1, 2] = pairs, 1
        plan = plan_of(counts, guest_slots=1)
        slot_expert, route = np.array(plan.slot_expert), np.array(plan.route)
        slot_expert[1, 2] = 0
        route[0, 0, 0], route[0, 1, 2] = pairs // 2, pairs // 2
        whole = layer_time(Plan(slot_expert, route), TOPO, DIMS, PLACEMENT)
        sliced = layer_time(Plan(slot_expert, route), TOPO, dataclasses.replace(DIMS, weight_chunks=4), PLACEMENT)
        assert 0 < sliced["weights_s"] and (sliced["weights_s"] < whole["weights_s"]) == finer_is_faster
        assert all(sliced[k] == whole[k] for k in ("gemm_s", "exchange_s", "planning_s"))
    with pytest.raises(ValueError, match="weight_chunks = 3 must be a positive divisor of expert_hidden = 2000"):
        dataclasses.replace(DIMS, weight_chunks=3)


def test_ideal_layer_time_spreads_compute_and_traffic():
    from jtopoep.costmodel import ideal_layer_time

    counts = np.zeros((4, 8), np.int32)
    counts[:, 0] = [7, 7, 7, 7]
    t = ideal_layer_time(plan_of(counts), TOPO, DIMS)
    assert t["gemm_s"] == pytest.approx(7 * 18 * 1000 * 2000 / 5e14)
    # 7 intra and 14 inter pairs in all, a quarter of each per rank
    assert t["exchange_s"] == pytest.approx(4 * (max(7 / 4 * 2000 / 100e9, 14 / 4 * 2000 / 25e9) + 5e-6))
    assert t["total_s"] == pytest.approx(t["gemm_s"] + t["exchange_s"])


def test_inter_bytes_floor_is_reached_by_a_node_copy():
    """Expert 0 (home rank 0, node 0) takes 5000 pairs from every rank: node 1's 10,000 cross. One
    copy on node 1 fed by node 1 alone keeps them home at the price of one copy's weights and
    gradients crossing instead; that plan sits exactly on the floor."""
    from jtopoep.metrics import inter_bytes_floor
    from jtopoep.planners.routing import plan_from_quotas

    counts = np.zeros((4, 8), np.int32)
    counts[:, 0] = 5000
    token_bytes, copy_bytes = 1000 * 2 * 4, 2 * 3 * 1000 * 2000 * 2
    assert inter_bytes_floor(counts, TOPO, DIMS, 0) == 10_000 * token_bytes
    assert inter_bytes_floor(counts, TOPO, DIMS, 1) == 10_000 * token_bytes - (10_000 * token_bytes - copy_bytes)
    # A copy is worth it only while node 1's share outweighs the copy's own traffic.
    few = counts // 5000 * 1000
    assert inter_bytes_floor(few, TOPO, DIMS, 1) == 2000 * token_bytes
    slot_expert = np.concatenate([PLACEMENT, np.full((4, 1), -1)], axis=1)
    slot_expert[2, 2] = 0
    quota = np.zeros((4, 3), np.int32)
    quota[0, 0], quota[2, 2] = 10_000, 10_000
    plan = plan_from_quotas(counts, slot_expert, quota, 2, True, np)
    assert summarize(plan, counts, TOPO, DIMS)["inter_bytes"] == inter_bytes_floor(counts, TOPO, DIMS, 1)


def every_guest_layout(num_experts: int, guest_slots: int) -> np.ndarray:
    """[n, R, K] every way to fill the guest slots of TOPO's 4 ranks: each rank holds up to K distinct
    experts other than its own (-1 for an empty slot), in every combination over the ranks."""
    import itertools

    home = np.repeat(np.arange(4), num_experts // 4)
    per_rank = []
    for rank in range(4):
        others = [e for e in range(num_experts) if home[e] != rank]
        choices = [c for size in range(guest_slots + 1) for c in itertools.combinations(others, size)]
        per_rank.append([list(c) + [-1] * (guest_slots - len(c)) for c in choices])
    return np.array(list(itertools.product(*per_rank)))


@pytest.mark.parametrize("num_experts,guest_slots", [(8, 1), (4, 2)])
@pytest.mark.parametrize("seed", range(12))
def test_inter_bytes_floor_is_the_brute_force_minimum(num_experts, guest_slots, seed):
    """The floor against every guest layout of a 2 x 2 cluster. Without a balance constraint a pair
    best goes to a copy of its expert on its own node, if there is one, else home; so a layout's
    fewest inter-node bytes are the pairs of (remote node, expert) cells with no copy there, plus
    the weights and gradients of every copy held off its expert's home node. The floor must equal
    the least of those, and the plan that routes that best layout must measure exactly that."""
    from jtopoep.metrics import inter_bytes_floor
    from jtopoep.plan import check_plan
    from jtopoep.planners.routing import plan_from_quotas

    rng = np.random.default_rng(seed)
    # Scales around a copy's break-even (3000 pairs at these shapes), so that copies pay on some
    # cells and not on others.
    counts = rng.integers(0, rng.integers(500, 4000), size=(4, num_experts)).astype(np.int32)
    counts[:, rng.integers(num_experts)] += rng.integers(0, 3000, size=4).astype(np.int32)
    token_bytes, copy_bytes = DIMS.pair_bytes * 4, 2 * DIMS.expert_bytes
    home_node = np.repeat(np.arange(4), num_experts // 4) // 2
    share = counts.reshape(2, 2, num_experts).sum(1).astype(np.float64)  # [node, expert]
    remote = np.arange(2)[:, None] != home_node[None, :]

    layouts = every_guest_layout(num_experts, guest_slots)  # [n, R, K]
    node_of_slot = np.repeat(np.arange(4) // 2, guest_slots)
    guests = layouts.reshape(len(layouts), -1)
    held = np.zeros((len(layouts), 2, num_experts), bool)  # a copy of the expert on the node
    for slot, node in enumerate(node_of_slot):
        held[np.arange(len(layouts)), node, np.maximum(guests[:, slot], 0)] |= guests[:, slot] >= 0
    off_home = (guests >= 0) & (node_of_slot[None, :] != home_node[np.maximum(guests, 0)])
    best = (np.where(remote[None] & ~held, share[None], 0.0).sum((1, 2)) * token_bytes
            + off_home.sum(1) * copy_bytes)
    floor = inter_bytes_floor(counts, TOPO, DIMS, guest_slots)
    assert floor == pytest.approx(best.min(), rel=1e-12)

    # Route the best layout: each node's first copy of an expert takes that node's pairs of it.
    layout = layouts[np.argmin(best)]
    placement = np.arange(num_experts).reshape(4, -1)
    home_slots = placement.shape[1]
    slot_expert = np.concatenate([placement, layout], axis=1)
    quota = np.zeros(slot_expert.shape, np.int64)
    fed = np.zeros((2, num_experts), bool)
    for rank in range(4):
        for k in range(guest_slots):
            e, node = layout[rank, k], rank // 2
            if e >= 0 and remote[node, e] and not fed[node, e]:
                quota[rank, home_slots + k], fed[node, e] = share[node, e], True
    loads = counts.sum(0)
    for rank in range(4):
        for h in range(home_slots):
            e = slot_expert[rank, h]
            quota[rank, h] = loads[e] - np.where(slot_expert[:, home_slots:] == e, quota[:, home_slots:], 0).sum()
    plan = plan_from_quotas(counts, slot_expert, quota, 2, True, np)
    check_plan(plan, counts, placement)
    assert summarize(plan, counts, TOPO, DIMS, placement)["inter_bytes"] == pytest.approx(floor, rel=1e-12)


def test_relay_exchange_prices_rows_across_nodes_then_pairs_over_nvlink():
    """Rank 0 (node 0) sends 3 pairs to rank 2 and 2 to rank 3 (node 1) from 4 distinct tokens: stage
    1 moves 4 rows to relay rank 2 (rank 0's GPU index on node 1), stage 2 the 2 pairs for rank 3
    over NVLink; the flat exchange moves all 5 pairs across."""
    topo = Topology(2, 2)
    dims = ExpertDims(d_model=1024, expert_hidden=64)
    route = np.zeros((4, 4, 1), np.int32)
    route[0, 2, 0], route[0, 3, 0] = 3, 2
    plan = Plan(jnp.arange(4, dtype=jnp.int32)[:, None], jnp.asarray(route))
    node_rows = np.zeros((4, 2), np.int32)
    node_rows[0, 1] = 4
    got = relay_exchange_seconds_per_rank(plan, node_rows, topo, dims)
    across, within = dims.pair_bytes / topo.inter_bw, dims.pair_bytes / topo.intra_bw
    np.testing.assert_allclose(got, [4 * across, 0.0, 4 * across + 2 * within, 2 * within])
    flat = layer_time(plan, topo, dims, np.arange(4)[:, None])["exchange_s"]
    relay = layer_time(plan, topo, dims, np.arange(4)[:, None], node_rows=node_rows)["exchange_s"]
    assert relay < flat


def test_migration_seconds_prices_moves_by_link_and_amortises():
    from jtopoep.costmodel import migration_seconds

    topology = Topology(2, 2)
    dims = ExpertDims(8, 4)
    old = np.arange(8).reshape(4, 2)
    assert migration_seconds(old, old, topology, dims) == 0.0
    expert = 3 * 8 * 4 * 12  # weights and two moments, float32
    within = old.copy()
    within[[0, 1], 0] = within[[1, 0], 0]  # experts 0 and 2 trade ranks 0 and 1 (one node)
    assert migration_seconds(old, within, topology, dims) == pytest.approx(expert / topology.intra_bw)
    across = old.copy()
    across[[0, 2], 0] = across[[2, 0], 0]  # experts 0 and 4 trade ranks 0 and 2 (two nodes)
    assert migration_seconds(old, across, topology, dims) == pytest.approx(expert / topology.inter_bw)
    assert migration_seconds(old, across, topology, dims, replace_every=10) == pytest.approx(
        expert / topology.inter_bw / 10)
