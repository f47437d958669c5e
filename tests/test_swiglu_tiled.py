"""The tiled SwiGLU (jtopoep.swiglu_tiled) against the SwiGLU composed of jax.lax.ragged_dot GEMMs:
values and every gradient, home slots with and without guest slices, slots spanning tiles, empty
slots and rows past the groups; and inside shard_map, where its carries and cotangents must vary
over the mesh axes as its inputs do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtopoep import gemm_tiled
from jtopoep.dispatch import expert_ffn
from jtopoep.guests import ExpertWeights, hidden_slice
from jtopoep.swiglu_tiled import tiled_swiglu

ROWS, DEPTH, HIDDEN, HOME, GUESTS = 40, 6, 8, 3, 2


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # Tiles of 8 and 16 rows, so that slots span tiles and tiles hold several slots.
    monkeypatch.setattr(gemm_tiled, "ROW_TILE", 8)
    monkeypatch.setattr(gemm_tiled, "WEIGHT_GRADIENT_TILE", 16)


def _weights(key, experts, scale=1.0):
    shapes = [(experts, DEPTH, HIDDEN), (experts, DEPTH, HIDDEN), (experts, HIDDEN, DEPTH)]
    return ExpertWeights(*(scale * jax.random.normal(k, s) for k, s in zip(jax.random.split(key, 3), shapes)))


def _value_and_gradients(gemm, x, home, slices, sizes):
    def loss(x, home, slices):
        y = expert_ffn(x, home, slices, sizes, gemm)
        return (y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))).sum(), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, home, slices)


def _sizes(rng, slots: int) -> jnp.ndarray:
    while True:
        sizes = rng.integers(0, 13, slots)
        if sizes.sum() <= ROWS:
            return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("chunks", [None, 1, 2])
def test_tiled_swiglu_matches_composed_gemms(chunks):
    """chunks None: home slots only; else guest slots in that many hidden slices."""
    kx, kh, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (ROWS, DEPTH))
    home = _weights(kh, HOME)
    slices = None if chunks is None else tuple(hidden_slice(_weights(kg, GUESTS), c, chunks) for c in range(chunks))
    slots = HOME + (0 if chunks is None else GUESTS)
    tiled = jax.jit(lambda *a: _value_and_gradients("tiled", *a))
    reference = jax.jit(lambda *a: _value_and_gradients("xla", *a))
    rng = np.random.default_rng(chunks or 0)
    cases = [jnp.zeros(slots, jnp.int32), jnp.full(slots, ROWS // slots, jnp.int32)]
    cases += [_sizes(rng, slots) for _ in range(12)]
    for sizes in cases:
        got, want = tiled(x, home, slices, sizes), reference(x, home, slices, sizes)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max() + 1))
        (_, y), (grad_x, *_) = got
        past = int(sizes.sum())
        assert not np.asarray(y[past:]).any() and not np.asarray(grad_x[past:]).any(), "rows past the groups"


def test_tiled_swiglu_refuses_slices_that_do_not_make_the_hidden_width():
    home = _weights(jax.random.key(0), HOME)
    part = hidden_slice(_weights(jax.random.key(1), GUESTS), 0, 2)
    with pytest.raises(ValueError, match="the guest slices' hidden widths add up to 4; the home experts' is 8"):
        tiled_swiglu(jnp.ones((ROWS, DEPTH)), home, (part,), jnp.zeros(HOME + GUESTS, jnp.int32))


def test_tiled_swiglu_inside_shard_map_matches_composed_gemms(devices):
    """Per rank its own rows, home and guest weights and groups: values and gradients as the
    composed GEMMs give them, and shard_map accepts the backward's cotangents."""
    mesh = jax.make_mesh((2, 4), ("node", "gpu"), devices=devices)
    ranks = 8
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (ranks * ROWS, DEPTH))
    home = _weights(keys[1], ranks * HOME)
    guest = _weights(keys[2], ranks * GUESTS)
    sizes = jnp.concatenate([_sizes(np.random.default_rng(r), HOME + GUESTS) for r in range(ranks)])
    spec = P(("node", "gpu"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    x, home, guest, sizes = put(x), jax.tree.map(put, home), jax.tree.map(put, guest), put(sizes)

    def run(gemm):
        def body(x, home, guest, sizes):
            def loss(x, home, guest):
                slices = tuple(hidden_slice(guest, c, 2) for c in range(2))
                y = expert_ffn(x, home, slices, sizes, gemm)
                return jax.lax.psum((y * y).sum(), ("node", "gpu"))

            return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, home, guest)

        weights_spec = ExpertWeights(spec, spec, spec)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, weights_spec, weights_spec, spec),
                                     out_specs=(P(), (spec, weights_spec, weights_spec))))(x, home, guest, sizes)

    for g, w in zip(jax.tree.leaves(run("tiled")), jax.tree.leaves(run("xla"))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max() + 1))


def test_guest_slices_add_no_buffer_sized_temporaries(monkeypatch):
    """XLA's memory analysis of the compiled gradient: with two guest slices the tiled SwiGLU's
    temporaries stay within one [rows, D] buffer of the home slots' alone (the guest loops write into
    the home loop's buffers), where three GEMMs a weight set gave every guest GEMM its own."""
    monkeypatch.setattr(gemm_tiled, "ROW_TILE", 1024)
    monkeypatch.setattr(gemm_tiled, "WEIGHT_GRADIENT_TILE", 2048)
    rows, depth, hidden = 4096, 256, 512

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def weights(experts, width):
        return ExpertWeights(spec(experts, depth, width), spec(experts, depth, width), spec(experts, width, depth))

    def temporaries(slices, slots):
        grad = jax.grad(lambda x, h, s, z: (expert_ffn(x, h, s, z, "tiled") ** 2).sum(), argnums=(0, 1, 2))
        compiled = jax.jit(grad).lower(spec(rows, depth), weights(HOME, hidden), slices,
                                       jax.ShapeDtypeStruct((slots,), jnp.int32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    alone = temporaries(None, HOME)
    with_guests = temporaries((weights(GUESTS, hidden // 2),) * 2, HOME + GUESTS)
    assert with_guests - alone < rows * depth * 4, (alone, with_guests)
