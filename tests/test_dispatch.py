"""The distributed MoE layer against a dense single-device loop over experts (fp32, atol 1e-5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Var
from jax.sharding import PartitionSpec as P

from jtopoep import gemm_tiled
from jtopoep.dispatch import ExpertWeights, assign_slots, expert_ffn, moe_dispatch
from jtopoep.gemm import grouped_matmul
from jtopoep.guests import GuestCopies, hidden_slice
from jtopoep.plan import check_plan, contiguous_placement
from jtopoep.planners import get_planner
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.topology import Topology, make_mesh
from jtopoep.transport import exchange, regroup
from test_routing import loop_cuts

R, E, T, K_TOP, D, F = 8, 16, 5, 2, 6, 7  # sizes that do not divide evenly
SPEC = P(("node", "gpu"))
ATOL = 1e-5


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    p = np.ones(E)
    p[[0, 9]] = [12.0, 6.0]  # two hot experts on different nodes, so guests are needed
    ids = np.stack([rng.choice(E, K_TOP, replace=False, p=p / p.sum()) for _ in range(R * T)]).astype(np.int32)
    x = rng.normal(size=(R * T, D)).astype(np.float32)
    gates = rng.uniform(size=(R * T, K_TOP)).astype(np.float32)
    w = ExpertWeights(*(rng.normal(size=s).astype(np.float32) * 0.4 for s in [(E, D, F), (E, D, F), (E, F, D)]))
    return x, ids, gates, w


def swiglu_rows(x, w, e):
    """Each row of x through the SwiGLU expert e[row], one row at a time."""
    g = jnp.einsum("td,tdf->tf", x, w.gate[e])
    u = jnp.einsum("td,tdf->tf", x, w.up[e])
    return jnp.einsum("tf,tfd->td", jax.nn.silu(g) * u, w.down[e])


def reference(x, ids, gates, w):
    out = jnp.zeros_like(x)
    for j in range(K_TOP):
        out += gates[:, j:j + 1] * swiglu_rows(x, w, ids[:, j])
    return out


@functools.lru_cache(maxsize=None)
def layer(preset, planner_name, hierarchical, recv_rows=None, guest_slots=2, gemm="auto"):
    topo = Topology.preset(preset)
    planner = get_planner(planner_name, topology=topo, num_experts=E,
                          guest_slots=0 if planner_name == "none" else guest_slots)
    placement = contiguous_placement(R, E)

    def body(x, ids, gates, wg, wu, wd):
        y, stats = moe_dispatch(x, ids, gates, ExpertWeights(wg, wu, wd), placement, planner, backend="dense",
                                hierarchical=hierarchical, recv_rows=recv_rows, gemm=gemm)
        return y, jax.tree.map(lambda a: a[None], (stats.quotas, stats.dropped, stats.scaleout_rows))

    fn = jax.shard_map(body, mesh=make_mesh(topo), in_specs=(SPEC,) * 6, out_specs=(SPEC, SPEC))

    def loss(x, gates, w, ids):
        y, stats = fn(x, ids, gates, *w)
        return (jnp.sin(y) * y).sum(), (y, stats)

    # The forward alone, and ((loss, (y, stats)), gradients) in one program: a test that checks both
    # compiles the layer once.
    return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def dense_plan(preset, planner_name, quotas, counts):
    """The whole plan of the slots and quotas the layer's first rank reported."""
    first = jax.tree.map(lambda a: np.asarray(a)[0], quotas)
    tiered = get_planner(planner_name, topology=Topology.preset(preset), num_experts=E, guest_slots=2).tiered
    return plan_from_quotas(counts, first.slot_expert, first.quota, Topology.preset(preset).gpus_per_node, tiered, np)


def ref_loss(x, gates, w, ids):
    y = reference(x, ids, gates, w)
    return (jnp.sin(y) * y).sum()


# A case's last two elements: rows of each receive buffer, where None is room for every pair of
# every source (R * T * k) and 2 * T * K_TOP twice a rank's own pairs, which these balanced plans
# never exceed; and the grouped GEMM, the tiled loop with tiles of 16 rows so that slots span tiles
# and tiles hold several slots. Planners differ only in the plan they hand the dispatch; the
# transport paths (flat, hierarchical, each mesh shape, bounded buffers) are what the cases span.
CASES = [("cpu-2x4", "none", False, None, "xla"), ("cpu-2x4", "none", True, None, "xla"),
         ("cpu-2x4", "topoep", False, None, "xla"), ("cpu-2x4", "topoep", True, None, "tiled")]
CASES += [("cpu-2x4", "eplb", False, None, "xla"), ("cpu-2x4", "taot", True, None, "xla")]
CASES += [("cpu-1x8", "topoep", False, 2 * T * K_TOP, "xla"), ("cpu-4x2", "topoep", True, 2 * T * K_TOP, "xla"),
          ("cpu-4x2", "taot", False, None, "xla")]


@pytest.mark.parametrize("preset,planner_name,hierarchical,recv_rows,gemm", CASES)
def test_layer_matches_dense_loop(devices, monkeypatch, preset, planner_name, hierarchical, recv_rows, gemm):
    monkeypatch.setattr(gemm_tiled, "ROW_TILE", 16)
    monkeypatch.setattr(gemm_tiled, "WEIGHT_GRADIENT_TILE", 16)
    x, ids, gates, w = make_inputs()
    _, grads = layer(preset, planner_name, hierarchical, recv_rows, gemm=gemm)
    (value, (y, (quotas, dropped, _))), grad = grads(x, gates, w, ids)
    assert (np.asarray(dropped) == 0).all()
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference(x, ids, gates, w)), atol=ATOL, rtol=0)
    counts = np.zeros((R, E), np.int32)
    for t in range(R * T):
        for e in ids[t]:
            counts[t // T, e] += 1
    plan = dense_plan(preset, planner_name, quotas, counts)
    if recv_rows is not None:
        assert plan.route.sum((0, 2)).max() <= recv_rows
    check_plan(plan, counts)
    if planner_name != "none":
        assert (plan.slot_expert[:, E // R:] >= 0).any(), "the load should make the planner use guest slots"
    want_value, want = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(x, gates, w, ids)
    np.testing.assert_allclose(float(value), float(want_value), atol=ATOL * 10, rtol=1e-6)
    for got, exp in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=ATOL, rtol=0)


def test_each_rank_processes_its_plan_load(devices):
    """Pairs carry their expert id through assign -> permute -> exchange -> regroup: every slot
    receives exactly the plan's pairs, all of them for the expert the slot holds."""
    topo = Topology.preset("cpu-2x4")
    planner = get_planner("topoep", topology=topo, num_experts=E, guest_slots=2)
    placement = contiguous_placement(R, E)
    _, ids, _, _ = make_inputs(1)

    def body(local_ids):
        flat = local_ids.reshape(-1)
        local_counts = jnp.zeros(E, jnp.int32).at[flat].add(1)
        plan = planner(jax.lax.all_gather(local_counts, ("node", "gpu")), placement)
        me = jax.lax.axis_index("node") * 4 + jax.lax.axis_index("gpu")
        dest = assign_slots(flat, local_counts, plan.slot_expert, plan.route[me])
        order = jnp.argsort(dest, stable=True)
        received = exchange(flat[order] + 1, plan.route.sum(2), out_rows=R * flat.shape[0], gpus_per_node=4,
                            backend="dense")
        my_route = plan.route[:, me]
        return regroup(received, my_route)[None], my_route.sum(0)[None], plan.slot_expert[me][None]

    fn = jax.jit(jax.shard_map(body, mesh=make_mesh(topo), in_specs=SPEC, out_specs=(SPEC, SPEC, SPEC)))
    rows, group_sizes, slot_expert = (np.asarray(a) for a in fn(ids))
    for r in range(R):
        start = 0
        for j, size in enumerate(group_sizes[r]):
            np.testing.assert_array_equal(rows[r, start:start + size], slot_expert[r, j] + 1)
            start += size
        assert (rows[r, start:] == 0).all(), "rows past the plan's load must be empty"
    loads = group_sizes.sum(1)
    assert loads.sum() == R * T * K_TOP


def test_jitted_step_has_no_host_transfer(devices):
    x, ids, gates, w = make_inputs()
    _, grads = layer("cpu-2x4", "taot", True, None, gemm="xla")  # a CASES program: compiled once for the run
    sharding = jax.sharding.NamedSharding(make_mesh(Topology.preset("cpu-2x4")), SPEC)
    args = jax.device_put((x, gates, w, ids), sharding)
    jax.block_until_ready(grads(*args))  # compile outside the guard
    with jax.transfer_guard("disallow"):
        jax.block_until_ready(grads(*args))
    jaxpr = str(jax.make_jaxpr(grads)(*args))
    assert "callback" not in jaxpr and "pure_callback" not in jaxpr


def test_bfloat16_layer_moves_bfloat16_and_routes_like_float32(devices):
    """MoELayer on bfloat16 activations: float32 parameters are cast before the dispatch, so every
    exchange (tokens, guest weights) moves bfloat16; the router still works in float32, so on inputs
    that bfloat16 represents exactly it picks the same experts as in float32; the output is the
    float32 layer's up to bfloat16 rounding."""
    from flax import nnx

    from jtopoep.config import MoEConfig
    from jtopoep.layer import MoELayer

    topo = Topology.preset("cpu-2x4")
    mesh = make_mesh(topo)
    moe = MoEConfig(planner="topoep", guest_slots=2, price_transfers=False, transport="dense", guest_weight_chunks=1,
                    recv_capacity_factor=0.0)
    layer_ = MoELayer(D * 2, E, K_TOP, F, moe, topo, mesh, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(R, T, D * 2)), jnp.bfloat16)

    @nnx.jit
    def run(layer_, x):
        return layer_(x)

    y16, stats16 = run(layer_, x)
    y32, stats32 = run(layer_, x.astype(jnp.float32))
    assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(stats16["counts"]), np.asarray(stats32["counts"]))
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), rtol=0,
                               atol=0.05 * float(jnp.abs(y32).max()))
    assert (np.asarray(stats16["counts"]) > 0).any()
    assert int(stats16["dropped_pairs"]) == 0 and layer_.recv_rows(T) == R * T * K_TOP  # room for every pair
    # The program as lowered, before XLA:CPU's float normalisation widens bfloat16 collectives it
    # does not implement (GPU backends keep them).
    hlo = jax.jit(lambda x: nnx.merge(*nnx.split(layer_))(x)).lower(x).as_text()
    exchanges = [line.split("->")[-1] for line in hlo.splitlines() if "all_to_all" in line and "->" in line]
    assert any("bf16>" in types for types in exchanges), exchanges  # tokens and guest weights
    assert not any("f32>" in types for types in exchanges), exchanges


@pytest.mark.parametrize("preset,hierarchical", [("cpu-2x4", False), ("cpu-2x4", True), ("cpu-4x2", True)])
def test_receive_buffer_too_small_cuts_the_last_pairs_and_counts_them(devices, preset, hierarchical):
    """recv_rows below a rank's planned load (here the `none` plan of two hot experts): each
    destination keeps its first recv_rows rows in (source, slot) order, and with the relay dispatch
    each relay then its first recv_rows pairs in (source node, destination gpu, slot) order; a
    source's pairs of an expert fill that expert's slots in order, so the pairs cut are the last ones
    of each expert. They contribute nothing, every other pair exactly what the dense loop gives, and
    `dropped` counts them on every rank."""
    recv_rows = T * K_TOP  # a rank's own pairs; the hot experts' homes get more
    x, ids, gates, w = make_inputs()
    forward, _ = layer(preset, "none", hierarchical, recv_rows)
    y, (quotas, dropped, _) = forward(x, ids, gates, *w)
    counts = np.zeros((R, E), np.int32)
    np.add.at(counts, (np.arange(R * T)[:, None] // T, ids), 1)
    plan = dense_plan(preset, "none", quotas, counts)
    route = np.asarray(plan.route)  # [s, d, S]
    slot_expert = np.asarray(plan.slot_expert)
    num_slots = slot_expert.shape[1]
    # What each destination keeps, in (source, slot) order; with relays, then what each relay (n, g)
    # forwards from sources (n', g) to ranks (n, g').
    kept = loop_cuts(route, recv_rows, recv_rows if hierarchical else None, Topology.preset(preset).gpus_per_node)
    expected_dropped = route.sum() - kept.sum()
    assert expected_dropped > 0, "the test load must overflow some receive buffer"
    np.testing.assert_array_equal(np.asarray(dropped), expected_dropped)
    # Which pairs those are: each source's last pairs of an expert beyond what its slots keep.
    live = np.ones((R * T, K_TOP), bool)
    for s in range(R):
        for e in range(E):
            pairs = [(t, j) for t in range(s * T, (s + 1) * T) for j in range(K_TOP) if ids[t, j] == e]
            keep = sum(kept[s, d, j] for d in range(R) for j in range(num_slots) if slot_expert[d, j] == e)
            for t, j in pairs[keep:]:
                live[t, j] = False
    assert (~live).sum() == expected_dropped
    want = reference(x, ids, np.where(live, gates, 0.0), w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=ATOL, rtol=0)


@functools.lru_cache(maxsize=None)
def layer_keeping(hierarchical, chunks):
    """(first, loss_and_grads): the topoep layer on one micro-batch, returning the guest copies it
    holds after it; and value_and_grad of the loss on the next micro-batch given those copies."""
    topo = Topology.preset("cpu-2x4")
    planner = get_planner("topoep", topology=topo, num_experts=E, guest_slots=2)
    placement = contiguous_placement(R, E)
    run = functools.partial(moe_dispatch, placement=placement, planner=planner, backend="dense",
                            hierarchical=hierarchical, weight_chunks=chunks)

    def first(x, ids, gates, wg, wu, wd):
        _, stats = run(x, ids, gates, ExpertWeights(wg, wu, wd))
        return stats.guests.experts[None], stats.guests.weights

    def second(x, ids, gates, wg, wu, wd, held, hg, hu, hd):
        y, _ = run(x, ids, gates, ExpertWeights(wg, wu, wd), previous=GuestCopies(held[0], ExpertWeights(hg, hu, hd)))
        return jax.lax.psum((jnp.sin(y) * y).sum(), ("node", "gpu"))

    mesh = make_mesh(topo)
    first = jax.shard_map(first, mesh=mesh, in_specs=(SPEC,) * 6, out_specs=(SPEC, SPEC))
    second = jax.shard_map(second, mesh=mesh, in_specs=(SPEC,) * 10, out_specs=P())
    return jax.jit(first), jax.jit(jax.value_and_grad(
        lambda x, gates, w, ids, held: second(x, ids, gates, *w, held[0], *held[1]), argnums=(0, 1, 2)))


def test_layer_with_held_copies_and_guest_slices_matches_dense_loop(devices):
    """A second micro-batch that keeps the first one's copies (weights in 2 slices of 3 hidden units)
    gives the dense loop's values and gradients through the relays (the flat exchange with kept
    copies: test_guests and test_train; slices of one unit each: test_expert_ffn_*). Each slice is
    its own fetch of four exchanges, forward and backward: few slices keep the program small."""
    first, loss_and_grads = layer_keeping(True, 2)
    x, ids, gates, w = make_inputs(seed=0)
    w = ExpertWeights(w.gate[..., :6], w.up[..., :6], w.down[:, :6])
    held = first(x, ids, gates, *w)
    assert (np.asarray(held[0]) >= 0).any()
    x, ids, gates, _ = make_inputs(seed=5)
    value, grad = loss_and_grads(x, gates, w, ids, held)
    want_value, want = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(x, gates, w, ids)
    np.testing.assert_allclose(float(value), float(want_value), atol=ATOL * 10, rtol=1e-6)
    for got, exp in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", ["cpu-2x4", "cpu-4x2"])
def test_relay_dispatch_sends_each_token_once_per_node(devices, preset):
    """With the `none` plan a pair goes to its expert's home node: flat, every pair bound for another
    node crosses; with the relay dispatch, each token crosses once per other node it reaches."""
    x, ids, gates, w = make_inputs(seed=3)
    gpus = Topology.preset(preset).gpus_per_node
    home_node = np.arange(E) // (E // R) // gpus
    own_node = np.arange(R * T) // T // gpus
    pairs = (home_node[ids] != own_node[:, None]).sum()
    rows = sum(len(set(home_node[ids[t]]) - {own_node[t]}) for t in range(R * T))
    assert rows < pairs, "the load must send some token to one node twice"
    for hierarchical, want in ((False, pairs), (True, rows)):
        y, (_, _, scaleout) = layer(preset, "none", hierarchical)[0](x, ids, gates, *w)
        np.testing.assert_array_equal(np.asarray(scaleout), want)
        np.testing.assert_allclose(np.asarray(y), np.asarray(reference(x, ids, gates, w)), atol=ATOL, rtol=0)


# expert_ffn on its own: H home and G guest slots over a buffer with rows to spare past the groups.
FFN_SIZES = np.array([3, 0, 4, 2, 0, 5], np.int32)  # 3 home slots, 3 guest slots (one of each empty)
FFN_HOME, FFN_ROWS = 3, 17


def ffn_inputs():
    rng = np.random.default_rng(7)
    num_slots = FFN_SIZES.size
    w = ExpertWeights(*(rng.normal(size=s).astype(np.float32) * 0.4
                        for s in [(num_slots, D, F), (num_slots, D, F), (num_slots, F, D)]))
    return rng.normal(size=(FFN_ROWS, D)).astype(np.float32), w


def split(w):
    return (ExpertWeights(*(a[:FFN_HOME] for a in w)), ExpertWeights(*(a[FFN_HOME:] for a in w)))


def ffn_loss(x, w, chunks=1, gemm="xla", single_pass=False):
    home, guest = split(w)
    y = expert_ffn(x, home, tuple(hidden_slice(guest, c, chunks) for c in range(chunks)), jnp.asarray(FFN_SIZES),
                   gemm, single_pass)
    return (jnp.sin(y) * y).sum(), y


def ffn_reference_loss(x, w):
    slot = np.repeat(np.arange(FFN_SIZES.size), FFN_SIZES)
    y = swiglu_rows(x[:slot.size], w, slot)
    y = jnp.concatenate([y, jnp.zeros((FFN_ROWS - slot.size, D), y.dtype)])
    return (jnp.sin(y) * y).sum(), y


# F = 7 slices: the guest GEMM one hidden unit at a time; "pallas": megablox, in interpret mode here.
# single_pass: one GEMM per slice over home and guest slots together (as with the Hopper kernels).
@pytest.mark.parametrize("chunks,gemm,single_pass", [(1, "xla", False), (F, "xla", False), (1, "pallas", False),
                                                     (1, "xla", True), (F, "xla", True), (F, "tiled", False)])
def test_expert_ffn_matches_per_row_reference_with_gradients(chunks, gemm, single_pass):
    x, w = ffn_inputs()
    (got, y), grads = jax.value_and_grad(functools.partial(ffn_loss, chunks=chunks, gemm=gemm, single_pass=single_pass),
                                         argnums=(0, 1), has_aux=True)(x, w)
    (want, y_ref), ref_grads = jax.value_and_grad(ffn_reference_loss, argnums=(0, 1), has_aux=True)(x, w)
    np.testing.assert_allclose(y, y_ref, atol=ATOL)
    assert not np.asarray(y)[FFN_SIZES.sum():].any()  # rows past the groups are exactly zero
    np.testing.assert_allclose(got, want, atol=ATOL)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        # weight gradients sum up to 5 rows of values near 20: float32 rounding is relative there
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=ATOL)


def _depends_on(jaxpr, sources):
    """Variables of a flat jaxpr computed from any of `sources` (through any equation)."""
    tainted = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return tainted


def test_home_gemms_do_not_wait_for_guest_weights_nor_a_slice_for_the_next():
    """The home GEMMs depend on no guest weights, and each guest slice's GEMMs only on its own slice."""
    x, w = ffn_inputs()
    home, guest = split(w)
    # Two slices (of the seven one-unit slices of F = 7: only what depends on what is looked at).
    slices = (hidden_slice(guest, 0, F), hidden_slice(guest, 1, F))

    def fn(x, home, first, second):
        return expert_ffn(x, home, (first, second), jnp.asarray(FFN_SIZES))

    jaxpr = jax.make_jaxpr(fn)(x, home, *slices).jaxpr
    per = len(home)
    first = _depends_on(jaxpr, jaxpr.invars[1 + per:1 + 2 * per])
    second = _depends_on(jaxpr, jaxpr.invars[1 + 2 * per:])
    gemms = [e for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general"]
    uses = [(any(isinstance(v, Var) and v in first for v in e.invars),
             any(isinstance(v, Var) and v in second for v in e.invars)) for e in gemms]
    assert uses == [(False, False)] * 3 + [(True, False)] * 3 + [(False, True)] * 3, uses


def test_single_pass_sweeps_the_buffer_once_per_slice_over_every_slot():
    """single_pass: three GEMMs per slice, each over all H + K slots, slice c waiting only for guest
    slice c: each buffer row goes through the GEMMs once, not once for home and again for guest slots."""
    x, w = ffn_inputs()
    home, guest = split(w)
    slices = tuple(hidden_slice(guest, c, F) for c in range(F))

    def fn(x, home, *slices):
        return expert_ffn(x, home, slices, jnp.asarray(FFN_SIZES), single_pass=True)

    jaxpr = jax.make_jaxpr(fn)(x, home, *slices).jaxpr
    per = len(home)
    gemms = [e for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general"]
    assert [e.invars[2].aval.shape[0] for e in gemms] == [FFN_SIZES.size] * 3 * F
    for c in range(F):
        mine = _depends_on(jaxpr, jaxpr.invars[1 + per * (c + 1):1 + per * (c + 2)])
        uses = [any(isinstance(v, Var) and v in mine for v in e.invars) for e in gemms]
        assert uses == [g // 3 == c for g in range(3 * F)], (c, uses)


def test_layer_refuses_slices_that_do_not_divide_the_hidden_width(devices):
    from flax import nnx

    from jtopoep.config import MoEConfig
    from jtopoep.layer import MoELayer

    topo = Topology.preset("cpu-2x4")
    with pytest.raises(ValueError, match=r"moe\.guest_weight_chunks = 2 must be 0 \(by moe\.gemm\) or a divisor of "
                                         r"expert_hidden = 7"):
        MoELayer(D, E, K_TOP, F, MoEConfig(guest_weight_chunks=2), topo, make_mesh(topo), rngs=nnx.Rngs(0))


def test_layer_takes_the_default_slices_its_gemm_wants(devices):
    """moe.guest_weight_chunks 0 (the default): 4 slices with tiled, 2 with xla, never one that does not
    divide the hidden width (7: one slice); the planner's cost model prices the same slices."""
    from flax import nnx

    from jtopoep.config import MoEConfig
    from jtopoep.layer import MoELayer

    topo = Topology.preset("cpu-2x4")
    for gemm, hidden, slices in (("tiled", 8, 4), ("xla", 8, 2), ("tiled", 7, 1)):
        layer = MoELayer(D, E, K_TOP, hidden, MoEConfig(gemm=gemm), topo, make_mesh(topo), rngs=nnx.Rngs(0))
        assert layer.weight_chunks == slices and layer.planner.dims.weight_chunks == slices


def test_relay_dispatch_lowers_to_ragged_all_to_alls(devices):
    """With the ragged transport nothing is padded: the two stages and their reverses (stage 1 moves
    rows and their local slots), and the guest fetch's four exchanges, are all ragged all-to-alls."""
    topo = Topology.preset("cpu-2x4")
    planner = get_planner("topoep", topology=topo, num_experts=E, guest_slots=2)

    def body(x, ids, gates, wg, wu, wd):
        return moe_dispatch(x, ids, gates, ExpertWeights(wg, wu, wd), contiguous_placement(R, E), planner,
                            backend="ragged", hierarchical=True)[0]

    x, ids, gates, w = make_inputs()
    fn = jax.shard_map(body, mesh=make_mesh(topo), in_specs=(SPEC,) * 6, out_specs=SPEC)
    text = jax.jit(fn).lower(x, ids, gates, *w).as_text()
    assert text.count("ragged_all_to_all") == 5 + 4
    assert "stablehlo.all_to_all" not in text
    # The backward pass reverses each exchange but stage 1's local slots (integers), its offsets known
    # to every rank (no all-to-all of them).
    grad = jax.jit(jax.grad(lambda x, *w: (fn(x, ids, gates, *w) ** 2).sum(), argnums=(0, 1, 2, 3)))
    text = grad.lower(x, *w).as_text()
    assert text.count("ragged_all_to_all") == (5 + 4) + (4 + 4)
    assert "stablehlo.all_to_all" not in text


def test_unknown_gemm_is_refused():
    with pytest.raises(ValueError, match=r"unknown grouped GEMM 'cublas'; known: \['auto', 'xla', 'pallas', 'tiled'\]"):
        grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.array([4], jnp.int32), "cublas")


def test_hopper_gemm_refuses_operands_its_tiles_do_not_fit():
    """The Mosaic GPU kernels run on a GPU only; their operand checks run anywhere."""
    from jtopoep.gemm_hopper import check_hopper_shapes, hopper_available

    assert not hopper_available()  # no Hopper GPU here: moe.gemm=pallas stays on megablox's interpret mode
    fits = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 256), jnp.bfloat16)
    check_hopper_shapes(*fits)
    with pytest.raises(ValueError, match=r"needs bfloat16 or float16 activations and weights of one dtype; "
                                         r"got float32 and bfloat16"):
        check_hopper_shapes(fits[0].astype(jnp.float32), fits[1])
    with pytest.raises(ValueError, match=r"needs d_model and expert_hidden \(per guest-weight slice: expert_hidden / "
                                         r"moe.guest_weight_chunks\) multiples of 128; got a \[128, 96\] expert matrix"):
        check_hopper_shapes(fits[0], jnp.ones((2, 128, 96), jnp.bfloat16))


def test_layer_with_scattered_homes_matches_dense_loop(devices):
    """Any placement works: the expert weights are stored in home-slot order (row r * H + h holds
    expert placement[r, h]), and the layer gives the dense loop's values and gradients."""
    topo = Topology.preset("cpu-2x4")
    placement = np.random.default_rng(11).permutation(E).reshape(R, E // R).astype(np.int32)
    planner = get_planner("topoep", topology=topo, num_experts=E, guest_slots=2, price_transfers=False)

    def body(x, ids, gates, wg, wu, wd):
        y, stats = moe_dispatch(x, ids, gates, ExpertWeights(wg, wu, wd), jnp.asarray(placement), planner,
                                backend="dense", hierarchical=True)
        return y, stats.quotas.slot_expert[None]

    fn = jax.shard_map(body, mesh=make_mesh(topo), in_specs=(SPEC,) * 6, out_specs=(SPEC, SPEC))

    def stored(w):  # row r * H + h holds expert placement[r, h]
        return ExpertWeights(*(a[placement.reshape(-1)] for a in w))

    def loss(x, gates, w, ids):
        y, slots = fn(x, ids, gates, *stored(w))
        return (jnp.sin(y) * y).sum(), (y, slots)

    x, ids, gates, w = make_inputs()
    grad, (y, slots) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, gates, w, ids)
    np.testing.assert_allclose(np.asarray(y), np.asarray(reference(x, ids, gates, w)), atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(slots)[0][:, :E // R], placement)
    assert (np.asarray(slots)[0][:, E // R:] >= 0).any()
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(x, gates, w, ids)
    for got, exp in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=ATOL, rtol=0)
