"""The grouped GEMMs against jax.lax.ragged_dot on CPU.

The tiled loop (jtopoep.gemm_tiled) runs here as it runs anywhere. The Hopper kernels
(jtopoep.gemm_hopper) run only on Hopper GPUs, so here they are stood in for by host callbacks that
compute the same products and, like the kernels, return values that carry no mesh axes: what is
checked is the wrapper (rows past the groups, the custom backward, the cotangent types inside
shard_map)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtopoep import gemm_hopper, gemm_tiled

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


def _value_and_gradients(matmul, x, w, sizes, cotangent):
    y, back = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
    return y, *back(cotangent)


def _tiled_cases(rows: int, groups: int, count: int) -> list[np.ndarray]:
    """Group sizes with empty groups, groups inside one tile, groups over several, rows past the groups."""
    rng = np.random.default_rng(rows)
    cases = [np.zeros(groups, int), np.eye(groups, dtype=int)[0] * rows, np.eye(groups, dtype=int)[-1] * rows]
    while len(cases) < count:
        sizes = rng.multinomial(int(rng.integers(0, rows + 1)), rng.dirichlet(np.ones(groups) * 0.5))
        cases.append(sizes)
    return cases


@pytest.mark.parametrize("rows", [37, 5])  # 37: five tiles, the last slid back over the fourth; 5: under a tile
def test_tiled_loop_matches_ragged_dot_with_gradients(monkeypatch, rows):
    """Values, input and weight gradients equal jax.lax.ragged_dot's for many group layouts, with
    tiles of 8 rows (16 for the weight gradient) so that groups span tiles and tiles hold several
    groups; rows past the groups give zeros and no gradient."""
    monkeypatch.setattr(gemm_tiled, "ROW_TILE", 8)
    monkeypatch.setattr(gemm_tiled, "WEIGHT_GRADIENT_TILE", 16)
    groups, rng = 4, np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(rows, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(groups, 5, 7)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(rows, 7)), jnp.float32)
    tiled = jax.jit(functools.partial(_value_and_gradients, gemm_tiled.tiled_grouped_matmul))
    reference = jax.jit(functools.partial(_value_and_gradients, jax.lax.ragged_dot))
    for sizes in _tiled_cases(rows, groups, 40):
        sizes = jnp.asarray(sizes, jnp.int32)
        for got, want in zip(tiled(x, w, sizes, cotangent), reference(x, w, sizes, cotangent)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"group sizes {sizes}")
        y, grad_x, _ = tiled(x, w, sizes, cotangent)
        assert not np.asarray(y)[int(sizes.sum()):].any() and not np.asarray(grad_x)[int(sizes.sum()):].any()


def test_tiled_loop_trip_count_is_static_and_bounded():
    """tiles + groups - 1 steps: a group boundary inside a tile adds one; empty groups add none."""
    sizes = jnp.asarray([3, 0, 9, 0, 20, 1], jnp.int32)
    items = gemm_tiled.WorkItems(sizes, rows=40, tile=8)
    assert items.count == 5 + 6 - 1
    owned = [(int(items.group[i]), int(items.own_start[i]), int(items.own_end[i])) for i in range(items.count)]
    assert [o for o in owned if o[2] > o[1]] == [(0, 0, 3), (2, 3, 8), (2, 8, 12), (4, 12, 16), (4, 16, 24),
                                                  (4, 24, 32), (5, 32, 33)]


def test_tiled_loop_refuses_an_empty_buffer_or_no_group():
    with pytest.raises(ValueError, match="needs at least one row and one group; got 0 rows and 2 groups"):
        gemm_tiled.tiled_grouped_matmul(jnp.ones((0, 3)), jnp.ones((2, 3, 4)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="got 4 rows and 0 groups"):
        gemm_tiled.tiled_grouped_matmul(jnp.ones((4, 3)), jnp.ones((0, 3, 4)), jnp.zeros(0, jnp.int32))


def test_hopper_wrapper_gradients_inside_shard_map_match_ragged_dot(devices, host_kernels):
    """Per rank its own rows, weights and groups (some rows past the groups): values and both
    gradients equal jax.lax.ragged_dot's, and the backward's cotangents vary over the mesh axes as
    their primals do (shard_map refuses them otherwise)."""
    _check_inside_shard_map(devices, gemm_hopper.hopper_grouped_matmul)


def test_tiled_loop_gradients_inside_shard_map_match_ragged_dot(devices, monkeypatch):
    """The tiled loop's carries and cotangents vary over the mesh axes as its inputs do."""
    monkeypatch.setattr(gemm_tiled, "ROW_TILE", 8)
    _check_inside_shard_map(devices, gemm_tiled.tiled_grouped_matmul)


def _check_inside_shard_map(devices, matmul):
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

    got_loss, (got_x, got_w) = per_rank(matmul)(x, w, sizes)
    want_loss, (want_x, want_w) = per_rank(jax.lax.ragged_dot)(x, w, sizes)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(np.asarray(got_x).reshape(ranks, ROWS, DEPTH)[0, int(np.asarray(sizes)[:GROUPS].sum()):]) == 0


def test_weight_chunks_resolve_by_gemm():
    """0 (the default) gives the most slices up to the GEMM's preference that divide F, and for the
    Hopper kernels fill their tiles; a set count stands."""
    from jtopoep.gemm import AUTO_WEIGHT_CHUNKS, resolve_weight_chunks

    assert [resolve_weight_chunks(0, g, 2048) for g in ("tiled", "xla", "pallas")] == [4, 2, 2]
    assert AUTO_WEIGHT_CHUNKS["tiled"] == 4
    assert resolve_weight_chunks(0, "tiled", 1410) == 3  # 1410 = 2 x 3 x 5 x 47: not a multiple of 4
    assert resolve_weight_chunks(0, "tiled", 7) == 1
    assert resolve_weight_chunks(0, "pallas", 1408) == 1  # 1408 = 11 x 128, but 704 is no multiple of 128
    assert resolve_weight_chunks(0, "pallas", 384) == 1 and resolve_weight_chunks(0, "pallas", 512) == 2
    assert resolve_weight_chunks(3, "tiled", 1410) == 3 and resolve_weight_chunks(2, "pallas", 1408) == 2
    with pytest.raises(ValueError, match="unknown grouped GEMM 'cublas'"):
        resolve_weight_chunks(0, "cublas", 64)
