"""Shared load generators and jitted planners for the planner tests (compiled once per setting)."""

import functools

import jax
import numpy as np
from hypothesis import strategies as st

from jtopoep.costmodel import ExpertDims
from jtopoep.planners import get_planner
from jtopoep.topology import Topology

TOPO = Topology.preset("cpu-2x4")
R = TOPO.num_ranks
DIMS = ExpertDims(d_model=16, expert_hidden=8, bytes_per_element=2)


@functools.lru_cache(maxsize=None)
def jitted(name: str, num_experts: int, guest_slots: int, min_gain: float = 0.0):
    planner = get_planner(name, topology=TOPO, num_experts=num_experts, guest_slots=guest_slots,
                          min_gain=min_gain, dims=DIMS)
    return planner, jax.jit(planner)


def adversarial(kind: str, num_experts: int, scale: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((R, num_experts), np.int32)
    if kind == "random":
        counts = rng.integers(0, scale + 1, size=(R, num_experts)).astype(np.int32)
    elif kind == "one_expert":
        counts[:, rng.integers(num_experts)] = scale
    elif kind == "one_source":
        counts[rng.integers(R)] = rng.integers(0, scale + 1, size=num_experts)
    elif kind == "zipf":
        p = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        counts = rng.multinomial(scale * 3 + 7, p[rng.permutation(num_experts)] / p.sum(), size=R).astype(np.int32)
    elif kind == "hot_rank":
        h = num_experts // R
        r = rng.integers(R)
        counts[:, r * h:(r + 1) * h] = rng.integers(scale // 2, scale + 1, size=(R, h))
        counts += rng.integers(0, 2, size=counts.shape).astype(np.int32)
    elif kind != "zero":
        raise ValueError(kind)
    return counts


KINDS = ["random", "one_expert", "one_source", "zipf", "hot_rank", "zero"]
loads = st.tuples(st.sampled_from(KINDS), st.integers(1, 997), st.integers(0, 2**16))
