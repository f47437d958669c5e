"""The benchmark scripts' building blocks run and produce sane numbers (small cases, no timing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cluster
from benchmarks.loads import all_families
from jtopoep.config import MoEConfig
from jtopoep.gemm import resolve_weight_chunks
from jtopoep.plan import check_plan
from jtopoep.topology import Topology


def test_load_families_have_the_right_shapes():
    families = all_families(32, 64, 256, quick=True)
    assert {"esft-intent", "esft-translation", "olmoe", "zipf-1.0", "bursts"} <= set(families)
    for name, mats in families.items():
        assert mats.ndim == 3 and mats.shape[1:] == (32, 64), name
        assert (mats.sum(2) > 0).all(), name


def test_more_guest_slots_balance_mixtral_as_well_as_two():
    """Mixtral's third MoE layer on h800-4x8 (one home expert per rank, copies priced): more guest
    slots never leave the busiest rank busier, and both plans come within 2% of the target (the
    last slivers of spill do not pay for a copy)."""
    import jax

    from jtopoep.planners import get_planner

    topology = Topology.preset("h800-4x8")
    dep = cluster.Deployment(cluster.load_model("mixtral-8x7b"), topology.num_ranks)
    counts = dep.expand(cluster.model_traces("mixtral-8x7b", topology.num_ranks, 1, None)[0][2])
    target = -(-counts.sum() // topology.num_ranks)
    busiest = []
    for slots in (2, 4):
        planner = get_planner("topoep", topology=topology, num_experts=dep.num_experts, guest_slots=slots,
                              dims=dep.dims)
        plan = jax.device_get(jax.jit(planner)(counts))
        check_plan(plan, counts, np.arange(dep.num_experts).reshape(topology.num_ranks, -1))
        busiest.append(np.asarray(plan.route).sum((0, 2)).max())
    assert busiest[1] <= busiest[0] <= 1.02 * target, busiest


def test_deployment_slices_and_pads():
    mixtral = cluster.Deployment(cluster.load_model("mixtral-8x7b"), 32)
    assert mixtral.slices == 4 and mixtral.num_experts == 32 and mixtral.dims.expert_hidden == 14336 // 4
    counts = np.arange(16).reshape(2, 8)
    np.testing.assert_array_equal(mixtral.expand(counts)[:, :8], np.repeat(counts, 4, axis=1)[:, :8])
    qwen = cluster.Deployment(cluster.load_model("qwen1.5-moe"), 32)
    assert qwen.slices == 1 and qwen.num_experts == 64
    expanded = qwen.expand(np.arange(60, dtype=np.int32)[None, :] + 1)
    # Four empty experts, one on each of four ranks spread over the mesh; the 60 others keep their order.
    np.testing.assert_array_equal(qwen.padding, [1, 17, 33, 49])
    assert (expanded[0, qwen.padding] == 0).all()
    np.testing.assert_array_equal(np.delete(expanded[0], qwen.padding), np.arange(1, 61))


def test_projection_orders_planners_sensibly():
    topology = Topology.preset("h800-4x8")
    mats = cluster.model_traces("deepseek-v2-lite", 32, 2, None)[:, :3]  # 3 layers of two micro-batches
    rows = cluster.project("deepseek-v2-lite", topology, 2, {}, mats, window=8, min_gain=0.0)
    assert rows["topoep_homes"]["step_s"] < rows["none"]["step_s"]
    # ideal's GEMM is a bound; its exchange is the home plan's traffic spread evenly, which copies
    # fed by their own node's pairs can beat (costmodel.ideal_layer_time), so its step is not one.
    assert rows["ideal"]["gemm_s"] <= rows["topoep"]["gemm_s"] and rows["topoep"]["step_s"] < rows["none"]["step_s"]
    assert rows["topoep"]["step_s"] < 1.1 * rows["ideal"]["step_s"]
    assert rows["taot"]["step_s"] < rows["none"]["step_s"]
    assert rows["none"]["gain_vs_none"] == 0.0 and rows["ideal"]["share_of_ideal_gain"] == 1.0


def test_projection_prices_the_hierarchical_dispatch_on_token_routing():
    """With token-level routing every plan's exchange is priced by its relays' rows: fewer rows than
    pairs cross nodes, so no balancing costs less than with the flat exchange, and re-placed homes
    (learned from the other micro-batch's loads and co-activation) do better than no balancing."""
    topology = Topology.preset("h800-4x8")
    tokens, counts = cluster.token_traces(32, 2)
    tokens, counts = tokens[:, :2], counts[:, :2]
    flat = cluster.project("deepseek-v2-lite", topology, 2, {}, counts, window=8, min_gain=0.0)
    relay = cluster.project("deepseek-v2-lite", topology, 2, {}, counts, window=8, min_gain=0.0, tokens=tokens)
    assert relay["none"]["exchange_s"] < flat["none"]["exchange_s"]
    assert relay["none"]["gemm_s"] == flat["none"]["gemm_s"]
    assert relay["topoep_homes"]["step_s"] < relay["none"]["step_s"]


def test_projection_with_kept_copies_saves_only_weight_transfers():
    """The same micro-batch twice in one step. eplb ignores what ranks hold, so it plans the same
    copies again, every one is held already and ships no weights: only its weights term falls.
    topoep and taot may move a copy to a rank that holds it, so their plans can differ a little, but
    their weights term falls too. A quarter of the scale-out bandwidth, so that every planner's
    transfers show (at full bandwidth the spread fetch hides topoep's and taot's here entirely)."""
    topology = Topology.preset("h800-4x8")
    topology = dataclasses.replace(topology, inter_bw=topology.inter_bw / 4)
    mats = cluster.model_traces("deepseek-v2-lite", 32, 1, None)[:, :3]
    mats = np.concatenate([mats, mats])
    fetched = cluster.project("deepseek-v2-lite", topology, 2, {}, mats, window=8, min_gain=0.0)
    kept = cluster.project("deepseek-v2-lite", topology, 2, {}, mats, window=8, min_gain=0.0, keep_copies=True)
    for name in ("none", "ideal"):
        assert kept[name] == fetched[name]
    for name in ("eplb", "eplb_host"):
        assert kept[name]["gemm_s"] == fetched[name]["gemm_s"] and kept[name]["exchange_s"] == fetched[name]["exchange_s"]
    for name in ("eplb", "eplb_host", "topoep", "taot"):
        assert 0 < kept[name]["weights_s"] < fetched[name]["weights_s"]


@pytest.mark.parametrize("gemm", ["xla", "tiled"])
def test_gpu_check_finds_the_home_gemms_in_the_schedule(devices, gemm):
    """The GPU check reads the compiled layer's schedule; on CPU (dense transport, synchronous
    collectives) it must still find the home-slot GEMMs (gate, up, down: three dots, or the tiled
    SwiGLU's one loop) and each guest slice's, and report no overlap."""
    from benchmarks import gpu_check

    out = {}
    gpu_check.guest_overlap(out, backend="dense", gemm=gemm)
    found = out["guest_overlap"]
    per_set = 3 if gemm == "xla" else 1
    assert len(found["home_gemms"]) == per_set and not found["async_starts"]
    assert found["home_gemms_inside_transfer"] is False
    # The guest weights come in the slices the default resolves to for this GEMM, each with its own GEMMs.
    slices = resolve_weight_chunks(MoEConfig.guest_weight_chunks, gemm, 96)  # gpu_check.layer_inputs: F = 96
    assert slices == (4 if gemm == "tiled" else 2)
    assert {c: len(v) for c, v in found["slice_gemms"].items()} == dict.fromkeys(range(slices), per_set)
    assert found["slice_gemms_inside_next_transfer"] == {}


def test_gpu_check_of_the_grouped_gemm_runs(devices):
    """The GPU check's grouped-GEMM accuracy and timing at a small shape, the tiled loop and XLA's
    ragged_dot on CPU: near the float32 product, and zeros past the groups though those rows hold 1e4."""
    from benchmarks import gpu_check

    out = {}
    gpu_check.grouped_gemm(out, d=128, f=128, rows=96, slots=3)
    found = out["grouped_gemm"]
    assert found["hopper_kernels"] is False and "accuracy_pallas" not in found
    for gemm in ("tiled", "xla"):
        assert found[f"accuracy_{gemm}"]["rows_past_groups_zero"]
        assert max(found[f"accuracy_{gemm}"][k] for k in ("out_rel", "grad_x_rel", "grad_w_rel")) < 1e-2
        timed = {k for k in found if k.startswith(f"{gemm}_buffer")}
        assert timed == {f"{gemm}_buffer_x{f}" for f in ("1", "1.25", "2")}


def test_gemm_benchmark_times_each_gemm():
    from benchmarks import gemm

    (row,) = gemm.measure([(64, 8, 8, 3)], rounds=1, pin=False)
    assert row["groups"] == 3 and row["xla_ms"] > 0 and row["tiled_ms"] > 0


def test_gpu_check_of_kept_copies_runs(devices):
    """The GPU check of kept guest copies, with the dense transport on both sides on CPU."""
    from benchmarks import gpu_check

    out = {}
    gpu_check.check_kept_copies(out, backend="dense")
    assert out["kept_copies"]["ok"] and out["kept_copies"]["max_abs_diff_vs_dense"] == 0.0
    assert out["kept_copies"]["kept"] > 0
    gpu_check.check_migration(out, backend="dense")  # the migration check, dense transport
    assert out["migration"]["ok"]




def test_deepseek_eplb_replicates_by_load_and_packs_evenly():
    from benchmarks import deepseek_eplb

    loads = np.array([90.0, 10, 10, 10, 5, 5, 5, 5])
    replicas = deepseek_eplb.replicate(loads, 12)
    assert replicas.sum() == 12 and replicas[0] == 5  # 90 / 5 = 18 is the largest load per replica
    packs = deepseek_eplb.pack(np.array([5.0, 4, 3, 3, 2, 1]), 3)
    assert np.bincount(packs).tolist() == [2, 2, 2]
    assert sorted(np.bincount(packs, weights=[5.0, 4, 3, 3, 2, 1]).tolist()) == [6, 6, 6]
    rank_loads = deepseek_eplb.global_policy(loads, 4, 3)
    # Five replicas of 18 on four ranks: one holds two, plus the lightest replica (5): 41 is optimal.
    assert rank_loads.sum() == loads.sum() and rank_loads.max() == 41
    rank_loads = deepseek_eplb.hierarchical_policy(loads, 2, 2, 3, 2)
    assert rank_loads.sum() == loads.sum() and rank_loads.shape == (4,)


def test_scale_benchmark_loads_keep_every_pair():
    from benchmarks import scale

    for family in scale.FAMILIES:
        mats = scale.loads(family, 16, 256, steps=2)
        assert mats.shape == (2, 16, 256) and (mats.sum(2) == scale.TOKENS * scale.TOP_K).all(), family
        assert (mats <= scale.TOKENS).all()


def test_kernel_count_multiplies_loop_bodies_by_their_trip_count():
    """benchmarks.kernels counts a loop's body once per iteration, and refuses a loop whose trip
    count is not static."""
    from benchmarks.kernels import kernel_count

    def looped(trips):
        return jax.jit(lambda x: jax.lax.fori_loop(0, trips, lambda i, x: jnp.sin(x) @ x + i, x)).lower(
            jnp.ones((8, 8))).compile().as_text()

    three, five, nine = (kernel_count(looped(n)) for n in (3, 5, 9))
    per_trip = (nine - five) // 4
    assert per_trip >= 1 and nine - five == 4 * per_trip and five - three == 2 * per_trip
    open_ended = jax.jit(lambda x: jax.lax.while_loop(lambda x: x.sum() < 100, lambda x: x * 2, x)).lower(
        jnp.ones(4)).compile().as_text()
    with pytest.raises(ValueError, match="a loop without a known trip count"):
        kernel_count(open_ended)


def test_the_cluster_projection_has_a_planning_latency_for_every_deployment():
    """benchmarks.cluster charges each deployment's planners at their projected GPU latency for its
    planner shape (kernels_h100.json, K = 1, 2, 4 at 32 GPUs and DeepSeek-V3 on 256), eplb_host at its
    host time where measured: the committed results cover every shape the projection runs, and a
    planner with more kernels is charged more."""
    import json

    latency = cluster.planning_latency(cluster.RESULTS / "planners.json", cluster.RESULTS / "kernels_h100.json")
    deployments = [(m, 32, k) for m in cluster.MODELS for k in (1, 2, 4)] + [("deepseek-v3", 256, 2)]
    for model, ranks, slots in deployments:
        charged = cluster.deployment_latency(latency, model, ranks, slots)
        assert all(charged[name] > 0 for name in ("eplb", "topoep", "taot")), (model, ranks, slots)
        if ranks == 32:
            assert charged["eplb_host"] > 0, (model, slots)
    kernels = json.loads((cluster.RESULTS / "kernels_h100.json").read_text())["by_shape"]
    for key, row in kernels.items():
        order = sorted(("eplb", "topoep", "taot"), key=row.get)
        assert [latency[key][name] for name in order] == sorted(latency[key][name] for name in order), key


def test_refitted_quotas_keep_every_pair_on_a_slot_of_its_expert():
    """benchmarks.plan_ahead's refit of fixed copies to new counts: a valid plan (every pair on a slot
    of its expert, none on an empty one), no worse balanced than the homes alone."""
    from benchmarks.plan_ahead import refit_quotas
    from jtopoep.planners.routing import plan_from_quotas

    rng = np.random.default_rng(0)
    placement = jnp.arange(32, dtype=jnp.int32).reshape(8, 4)
    counts = jnp.asarray(rng.poisson(rng.lognormal(2.0, 1.0, 32), (8, 32)), jnp.int32)
    # Each rank holds copies of an expert of the next rank and of the one after; rank 7's second slot is empty.
    ranks = np.arange(8)[:, None]
    guests = jnp.asarray(np.where((ranks == 7) & (np.arange(2) == 1), -1, (4 * ranks + [4, 9]) % 32), jnp.int32)
    slot_expert, quota = jax.jit(refit_quotas, static_argnums=3)(counts, placement, guests, 4)
    plan = plan_from_quotas(counts, slot_expert, quota, 4, True)
    check_plan(plan, counts)
    loads = np.asarray(plan.route).sum((0, 2))
    assert loads.max() <= np.asarray(counts).sum(0)[np.asarray(placement)].sum(1).max()
    assert np.asarray(quota)[:, 4:].sum() > 0 and np.asarray(quota)[7, 5] == 0
