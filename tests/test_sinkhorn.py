"""Sinkhorn against POT (an independent implementation) and on degenerate inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import ot
import pytest

from jtopoep.planners.sinkhorn import Sinkhorn, sinkhorn
from jtopoep.topology import Topology


@pytest.mark.parametrize("known_cost", [False, True], ids=["log-domain", "scaled"])
@pytest.mark.parametrize("n,m,seed", [(17, 29, 0), (5, 3, 1), (32, 32, 2)])
def test_matches_pot(n, m, seed, known_cost):
    """A cost traced runs the log-domain iterations; a NumPy cost known when tracing, whose kernel
    exp(-cost / eps) stays above SCALED_KERNEL_MIN (here >= exp(-10)), runs them on the scalings."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 1.0, n)
    b = rng.uniform(0.1, 1.0, m)
    b *= a.sum() / b.sum()
    cost = rng.uniform(0, 1, (n, m))
    eps = 0.1
    want = ot.sinkhorn(a / a.sum(), b / b.sum(), cost, eps, method="sinkhorn_log", numItermax=5000,
                       stopThr=1e-12) * a.sum()
    if known_cost:
        out = jax.jit(lambda a, b: sinkhorn(a, b, cost, eps, 500))(a, b)
    else:
        out = jax.jit(lambda a, b, c: sinkhorn(a, b, c, eps, 500))(a, b, cost)
    np.testing.assert_allclose(np.asarray(out.plan), want, atol=1e-5 * a.sum(), rtol=1e-3)
    assert float(out.marginal_error) < 1e-4


def test_marginal_error_falls_with_iterations():
    topo = Topology.preset("h800-4x8")
    rng = np.random.default_rng(3)
    loads = rng.integers(0, 1000, 32).astype(np.float32)
    a = np.maximum(loads - loads.mean(), 0)
    b = np.maximum(loads.mean() - loads, 0)
    cost = jnp.asarray(topo.link_cost())
    errors = [float(sinkhorn(a, b, cost, 0.05, it).marginal_error) for it in (1, 10, 200)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3


def test_both_forms_give_the_same_iterates():
    """TAOT's use: node link costs known when tracing, epsilon 1; after a few iterations (far from
    converged) the scalings' plan is the log-domain one up to float32 rounding."""
    cost = Topology.preset("h800-4x8").link_cost()[::8, ::8]
    rng = np.random.default_rng(4)
    for _ in range(5):
        a = rng.integers(0, 500, 4).astype(np.float32) * (rng.uniform(size=4) < 0.7)
        b = rng.integers(0, 500, 4).astype(np.float32)
        b *= a.sum() / max(b.sum(), 1.0)
        for iterations in (1, 3, 10):
            scaled = jax.jit(lambda a, b: sinkhorn(a, b, cost, 1.0, iterations))(a, b)
            logs = jax.jit(lambda a, b, c: sinkhorn(a, b, c, 1.0, iterations))(a, b, cost)
            np.testing.assert_allclose(np.asarray(scaled.plan), np.asarray(logs.plan), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("form", ["log-domain", "scaled"])
@pytest.mark.parametrize("case", ["one_supplier", "no_overload", "single_rank", "zero_columns"])
def test_degenerate_inputs_stay_finite(case, form):
    cost = Topology.preset("cpu-2x4").link_cost()  # NumPy: known when tracing
    # epsilon 0.01 puts the kernel below SCALED_KERNEL_MIN (log domain), 1.0 above it (scalings).
    epsilon = 0.01 if form == "log-domain" else 1.0
    a, b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    if case == "one_supplier":
        a[3] = 70.0
        b[[0, 5, 6]] = [10.0, 20.0, 40.0]
    elif case == "zero_columns":
        a[[1, 2]] = [3.0, 1.0]
        b[7] = 4.0
    elif case == "single_rank":
        a, b, cost = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros((1, 1))
    out = Sinkhorn(epsilon=epsilon, iterations=30)(a, b, cost)
    plan = np.asarray(out.plan)
    assert np.isfinite(plan).all() and np.isfinite(float(out.marginal_error))
    assert (plan[a == 0] == 0).all() and (plan[:, b == 0] == 0).all()
    np.testing.assert_allclose(plan.sum(1), a, rtol=1e-4, atol=1e-4)
    if case == "one_supplier":  # the cheaper intra-node destination (rank 0) is filled first
        assert plan[3, 0] == pytest.approx(10.0, rel=1e-3)


def test_bad_settings():
    with pytest.raises(ValueError, match="epsilon = 0"):
        Sinkhorn(epsilon=0.0)
    with pytest.raises(ValueError, match="iterations = 0"):
        Sinkhorn(iterations=0)
