import numpy as np
import pytest

from jtopoep.topology import Topology, make_mesh


def test_h800_4x8_link_cost_has_three_levels():
    topo = Topology.preset("h800-4x8")
    cost = topo.link_cost()
    assert cost.shape == (32, 32) and cost.dtype == np.float32
    assert np.all(np.diag(cost) == 0)
    ratio = np.float32(topo.intra_bw / topo.inter_bw)
    assert sorted(np.unique(cost).tolist()) == [0.0, 1.0, pytest.approx(float(ratio))]
    assert cost[0, 7] == 1.0 and cost[0, 8] == ratio and cost[31, 24] == 1.0 and cost[31, 23] == ratio
    assert np.array_equal(cost, cost.T)


@pytest.mark.parametrize("name,shape", [("h800-4x8", (4, 8)), ("h800-2x8", (2, 8)), ("cpu-1x8", (1, 8)),
                                        ("cpu-2x4", (2, 4)), ("cpu-4x2", (4, 2))])
def test_presets(name, shape):
    topo = Topology.preset(name)
    assert (topo.num_nodes, topo.gpus_per_node) == shape
    assert topo.num_ranks == shape[0] * shape[1]
    assert [topo.node_of(r) for r in range(topo.num_ranks)] == [r // shape[1] for r in range(topo.num_ranks)]


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="known presets.*cpu-2x4"):
        Topology.preset("a100-9x9")


@pytest.mark.parametrize("field,value", [("num_nodes", 0), ("gpus_per_node", 2.5), ("inter_bw", 0.0),
                                         ("mfu", 1.5), ("inter_latency", -1.0)])
def test_bad_topology(field, value):
    kwargs = dict(num_nodes=2, gpus_per_node=4)
    kwargs[field] = value
    # A wrong type is caught by the run-time jaxtyping/beartype check (TypeError) before __post_init__.
    with pytest.raises((ValueError, TypeError), match=field):
        Topology(**kwargs)


def test_make_mesh_axes(devices):
    mesh = make_mesh(Topology.preset("cpu-2x4"))
    assert mesh.axis_names == ("node", "gpu") and mesh.devices.shape == (2, 4)
    mesh = make_mesh(Topology(num_nodes=2, gpus_per_node=2), data=2)
    assert mesh.axis_names == ("data", "node", "gpu") and mesh.devices.shape == (2, 2, 2)


def test_make_mesh_too_few_devices(devices):
    with pytest.raises(ValueError, match="needs .* = 32 devices, but this process sees 8"):
        make_mesh(Topology.preset("h800-4x8"))
