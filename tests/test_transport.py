import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jtopoep import transport
from jtopoep.topology import Topology, make_mesh
from jtopoep.transport import exchange, ragged_all_to_all_dense, regroup, resolve_backend

R = 8


def ragged_all_to_all_model(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """NumPy model of jax.lax.ragged_all_to_all's documented semantics, all ranks at once."""
    result = output.copy()
    for s in range(R):
        for d in range(R):
            n = send_sizes[s, d]
            assert n == recv_sizes[d, s]
            result[d, output_offsets[s, d]:output_offsets[s, d] + n] = \
                operand[s, input_offsets[s, d]:input_offsets[s, d] + n]
    return result


@pytest.mark.parametrize("seed", range(5))
def test_dense_matches_ragged_semantics(devices, seed):
    rng = np.random.default_rng(seed)
    rows, out_rows, width = 9, 23, 3
    send = np.zeros((R, R), np.int32)
    in_off = np.zeros((R, R), np.int32)
    for s in range(R):  # arbitrary, non-contiguous slices of the operand
        send[s] = rng.integers(0, 3, R)
        in_off[s] = rng.integers(0, rows - send[s] + 1)
    recv = send.T.copy()
    out_off = np.zeros((R, R), np.int32)
    for d in range(R):  # receivers pack sources in a random order with gaps
        pos = 0
        for s in rng.permutation(R):
            pos += rng.integers(0, 2)
            out_off[s, d] = pos
            pos += send[s, d]
        assert pos <= out_rows
    operand = rng.normal(size=(R, rows, width)).astype(np.float32)
    output = rng.normal(size=(R, out_rows, width)).astype(np.float32)
    mesh = Mesh(np.asarray(devices), ("x",))

    def body(op, out, io, ss, oo, rs):
        return ragged_all_to_all_dense(op[0], out[0], io[0], ss[0], oo[0], rs[0], axis_name="x",
                                       capacity=rows)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    got = fn(operand, output, in_off, send, out_off, recv)
    want = ragged_all_to_all_model(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)


def expected_exchange(x, sizes, out_rows):
    out = np.zeros((R, out_rows) + x.shape[2:], x.dtype)
    for d in range(R):
        pos = 0
        for s in range(R):
            off = sizes[s, :d].sum()
            out[d, pos:pos + sizes[s, d]] = x[s, off:off + sizes[s, d]]
            pos += sizes[s, d]
    return out


@pytest.mark.parametrize("preset", ["cpu-1x8", "cpu-2x4", "cpu-4x2"])
def test_exchange(devices, preset):
    topo = Topology.preset(preset)
    rows = 11
    rng = np.random.default_rng(3)
    sizes = np.stack([rng.multinomial(rng.integers(0, rows + 1), np.ones(R) / R) for _ in range(R)]).astype(np.int32)
    x = rng.normal(size=(R, rows, 2)).astype(np.float32)

    def body(xl):
        return exchange(xl[0], jnp.asarray(sizes), out_rows=R * rows, gpus_per_node=topo.gpus_per_node,
                        backend="dense")[None]

    fn = jax.jit(jax.shard_map(body, mesh=make_mesh(topo), in_specs=P(("node", "gpu")),
                               out_specs=P(("node", "gpu"))))
    np.testing.assert_array_equal(np.asarray(fn(x)), expected_exchange(x, sizes, R * rows))


@pytest.mark.parametrize("preset", ["cpu-2x4", "cpu-1x8"])
def test_exchange_gradient_is_the_reverse_exchange(devices, preset):
    """The exchange's own backward (transport._into_zeros): each sent row's gradient is the cotangent
    of the row it became at its destination; unsent rows, and output rows nothing landed in, carry none."""
    topo = Topology.preset(preset)
    rows = 9
    rng = np.random.default_rng(5)
    sizes = np.stack([rng.multinomial(rng.integers(0, rows + 1), np.ones(R) / R) for _ in range(R)]).astype(np.int32)
    x = rng.normal(size=(R, rows, 3)).astype(np.float32)
    weight = rng.normal(size=(R, R * rows, 3)).astype(np.float32)

    def body(xl, wl):
        out = exchange(xl[0], jnp.asarray(sizes), out_rows=R * rows, gpus_per_node=topo.gpus_per_node,
                       backend="dense")
        return (out * wl[0]).sum()[None]

    spec = P(("node", "gpu"))
    fn = jax.shard_map(body, mesh=make_mesh(topo), in_specs=(spec, spec), out_specs=spec)
    grad = np.asarray(jax.jit(jax.grad(lambda x: fn(x, weight).sum()))(x))
    want = np.zeros_like(x)
    for s in range(R):
        for d in range(R):
            sent = sizes[s, :d].sum()  # where s's rows for d start, and where they land on d
            landed = sizes[:s, d].sum()
            want[s, sent:sent + sizes[s, d]] = weight[d, landed:landed + sizes[s, d]]
    np.testing.assert_array_equal(grad, want)


def test_regroup_gradient_is_the_inverse_regroup():
    rng = np.random.default_rng(2)
    sizes = jnp.asarray(rng.integers(0, 4, size=(3, 4)), jnp.int32)
    x = jnp.asarray(rng.normal(size=(int(sizes.sum()) + 3, 2)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    grad = jax.grad(lambda x: (regroup(x, sizes) * weight).sum())(x)
    # Autodiff of the plain gather (a scatter-add into zeros) gives the same.
    want = jax.grad(lambda x: (transport._regroup(x, sizes) * weight).sum())(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(regroup(weight, sizes.T)))


def test_regroup_is_segment_transpose():
    sizes = np.array([[2, 0, 1], [1, 3, 0]], np.int32)
    x = np.arange(9, dtype=np.float32)[:, None]  # rows 0..6 used, 7..8 padding
    # (p, q) segments: (0,0)=[0,1] (0,1)=[] (0,2)=[2] (1,0)=[3] (1,1)=[4,5,6] (1,2)=[]
    want = np.array([0, 1, 3, 4, 5, 6, 2, 0, 0], np.float32)[:, None]
    np.testing.assert_array_equal(np.asarray(regroup(jnp.asarray(x), jnp.asarray(sizes))), want)


def test_backend_names():
    assert resolve_backend("auto") == "dense"  # these tests run on CPU
    with pytest.raises(ValueError, match=r"unknown transport 'nccl'; known transports: \['auto', 'ragged', 'dense'\]"):
        resolve_backend("nccl")


def test_ragged_lowers_to_ragged_all_to_all(devices):
    topo = Topology.preset("cpu-2x4")
    sizes = jnp.ones((R, R), jnp.int32)

    def body(xl):
        return exchange(xl[0], sizes, out_rows=R, gpus_per_node=4, backend="ragged")[None]

    fn = jax.jit(jax.shard_map(body, mesh=make_mesh(topo), in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu"))))
    text = fn.lower(jnp.ones((R, R, 2))).as_text()
    assert len(re.findall(r"ragged_all_to_all", text)) == 1
