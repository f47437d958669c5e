"""The Hopper grouped GEMM's wrapper (jtopoep.gemm_hopper) on CPU: its kernels run only on Hopper
GPUs, so here they are stood in for by host callbacks that compute the same products and, like the
kernels, return values that carry no mesh axes. What is checked is the wrapper: rows past the groups,
the custom backward, and the cotangent types inside shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtopoep import gemm_hopper

ROWS, DEPTH, WIDTH, GROUPS = 24, 128, 128, 3  # the kernels' tiles: feature sizes multiples of 128


def _host_ragged_dot(x, weights, group_sizes, transpose_rhs):
    def compute(x, weights, group_sizes):
        out = np.zeros((x.shape[0], weights.shape[1] if transpose_rhs else weights.shape[2]), np.float32)
        start = 0
        for g, size in enumerate(group_sizes):
            w = weights[g].T if transpose_rhs else weights[g]
            out[start:start + size] = x[start:start + size].astype(np.float32) @ w.astype(np.float32)
            start += size
        return out.astype(x.dtype)

    width = weights.shape[1] if transpose_rhs else weights.shape[2]
    out = jax.pure_callback(compute, jax.ShapeDtypeStruct((x.shape[0], width), x.dtype), x, weights, group_sizes)
    return jnp.where(gemm_hopper._rows_used(group_sizes, x.shape[0]), out, 0)


def _host_weight_gradient(x, grad, group_sizes):
    def compute(x, grad, group_sizes):
        out = np.zeros((len(group_sizes), x.shape[1], grad.shape[1]), np.float32)
        start = 0
        for g, size in enumerate(group_sizes):
            out[g] = x[start:start + size].astype(np.float32).T @ grad[start:start + size].astype(np.float32)
            start += size
        return out.astype(x.dtype)

    shape = (group_sizes.shape[0], x.shape[1], grad.shape[1])
    return jax.pure_callback(compute, jax.ShapeDtypeStruct(shape, x.dtype), x, grad, group_sizes)


@pytest.fixture
def host_kernels(monkeypatch):
    monkeypatch.setattr(gemm_hopper, "_ragged_dot", _host_ragged_dot)
    monkeypatch.setattr(gemm_hopper, "_weight_gradient", _host_weight_gradient)


def test_hopper_wrapper_gradients_inside_shard_map_match_ragged_dot(devices, host_kernels):
    """Per rank its own rows, weights and groups (some rows past the groups): values and both
    gradients equal jax.lax.ragged_dot's, and the backward's cotangents vary over the mesh axes as
    their primals do (shard_map refuses them otherwise)."""
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), devices=devices)
    ranks = 8
    kx, kw = jax.random.split(jax.random.key(0))
    # The kernels take bfloat16; small integers keep every product and sum exact in it.
    x = jax.random.randint(kx, (ranks * ROWS, DEPTH), -1, 2).astype(jnp.bfloat16)
    w = jax.random.randint(kw, (ranks * GROUPS, DEPTH, WIDTH), -1, 2).astype(jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(0).integers(0, ROWS // GROUPS + 1, (ranks, GROUPS)), jnp.int32)
    spec = P(("node", "gpu"))
    x, w, sizes = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, w, sizes.reshape(-1)))

    def per_rank(matmul):
        def loss(x, w, sizes):
            y = matmul(x, w, sizes).astype(jnp.float32)
            return jax.lax.psum((y * (y > 0)).sum(), ("node", "gpu"))

        def body(x, w, sizes):
            return jax.value_and_grad(loss, argnums=(0, 1))(x, w, sizes)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(P(), (spec, spec))))

    got_loss, (got_x, got_w) = per_rank(gemm_hopper.hopper_grouped_matmul)(x, w, sizes)
    want_loss, (want_x, want_w) = per_rank(jax.lax.ragged_dot)(x, w, sizes)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(np.asarray(got_x).reshape(ranks, ROWS, DEPTH)[0, int(np.asarray(sizes)[:GROUPS].sum()):]) == 0
