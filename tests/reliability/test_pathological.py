"""Pathological routing through the whole layer, every planner: the output and gradients stay exact
against the dense loop, every pair is routed (none dropped with room for all), and pairs cut by a
small receive buffer are all counted. NaN router logits still give valid counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtopoep.config import MoEConfig
from jtopoep.layer import MoELayer
from jtopoep.plan import check_plan
from jtopoep.topology import Topology, make_mesh
from test_dispatch import ATOL, E, K_TOP, R, T, dense_plan, layer, make_inputs, ref_loss, reference


def routing(case: str, rng) -> np.ndarray:
    """ids i[R * T, k] of one pathological family (E = 16, two home experts per rank)."""
    tokens = R * T
    if case == "one expert in every token":  # expert 5 takes a slot of every token
        others = np.stack([rng.choice([e for e in range(E) if e != 5]) for _ in range(tokens)])
        return np.stack([np.full(tokens, 5), others], 1)
    if case == "the same k experts for every token":  # on two nodes
        return np.tile([3, 12], (tokens, 1))
    if case == "every hot expert on one rank":  # experts 0 and 1 both live on rank 0
        return np.tile([0, 1], (tokens, 1))
    if case == "more hot experts than guest slots":  # every expert of ranks 0-3 hot, 8 hot experts
        return np.stack([rng.choice(8, K_TOP, replace=False) for _ in range(tokens)])
    raise ValueError(case)


CASES = ("one expert in every token", "the same k experts for every token", "every hot expert on one rank",
         "more hot experts than guest slots")
PLANNERS = [("none", 0), ("eplb", 2), ("topoep", 2), ("taot", 1), ("topoep", 0)]


def pair_counts(ids):
    counts = np.zeros((R, E), np.int32)
    np.add.at(counts, (np.arange(R * T)[:, None] // T, ids), 1)
    return counts


@pytest.mark.parametrize("planner,slots", PLANNERS, ids=lambda v: str(v))
def test_pathological_routing_is_exact_for_every_planner(devices, planner, slots):
    x, _, gates, w = make_inputs(3)
    _, grads = layer("cpu-2x4", planner, True, None, slots)
    for case in CASES:
        ids = routing(case, np.random.default_rng(0)).astype(np.int32)
        (_, (y, (quotas, dropped, _))), grad = grads(x, gates, w, ids)
        assert (np.asarray(dropped) == 0).all(), case
        np.testing.assert_allclose(np.asarray(y), np.asarray(reference(x, ids, gates, w)), atol=ATOL, rtol=0,
                                   err_msg=case)
        counts = pair_counts(ids)
        check_plan(dense_plan("cpu-2x4", planner, quotas, counts), counts)
        want = jax.grad(ref_loss, argnums=(0, 1, 2))(x, gates, w, ids)
        for got, exp in zip(jax.tree.leaves(grad), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=ATOL, rtol=0, err_msg=case)


def test_pairs_cut_by_a_small_buffer_are_all_counted(devices):
    """Every hot expert on rank 0 and no copies: rank 0 receives every pair, and a buffer of a rank's
    own pairs cuts all but those; the count is exactly what did not fit."""
    x, _, gates, w = make_inputs(3)
    rows = T * K_TOP
    forward, _ = layer("cpu-2x4", "none", True, rows, 0)
    ids = routing("every hot expert on one rank", np.random.default_rng(0)).astype(np.int32)
    _, (_, dropped, _) = forward(x, ids, gates, *w)
    assert (np.asarray(dropped) == R * T * K_TOP - rows).all()


def test_nan_router_logits_still_give_valid_counts(devices):
    topology = Topology.preset("cpu-2x4")
    moe = MoELayer(8, E, K_TOP, 4, MoEConfig(planner="topoep", price_transfers=False), topology,
                   make_mesh(topology), rngs=nnx.Rngs(0))
    moe.router.set_value(moe.router.get_value().at[:, 3].set(jnp.nan).at[0, 7].set(jnp.inf))
    x = jax.random.normal(jax.random.key(1), (8, 4, 8))
    _, stats = nnx.jit(lambda m, x: m(x))(moe, x)
    counts = np.asarray(stats["counts"])
    assert counts.min() >= 0 and counts.sum() == 8 * 4 * K_TOP  # every pair counted once, in range
    assert int(stats["nonfinite_router"]) == 1
