"""The cluster a plan is made for: nodes of GPUs, the links between them, and their speeds.

Rank r sits on node r // G. Within a node GPUs talk over the scale-up fabric (NVLink), across nodes
over the scale-out fabric (InfiniBand/RoCE). Planners only see `link_cost()`; the cost model uses the
bandwidths, latencies and compute figures directly.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Float

# H800 SXM figures. NVLink: DeepEP's README measures ~153-158 GB/s per GPU one way for intranode
# dispatch/combine on H800 (NVLink 400 GB/s bidirectional, cut down from H100's 900). RDMA: one
# 400 Gb/s ConnectX-7 NIC per GPU; DeepEP measures 43-47 GB/s achieved one way. Latencies: DeepEP's
# low-latency kernels report ~ 8-10 us for small internode messages; NVLink P2P is ~2-3 us.
# Compute: H800 keeps H100 SXM's dense bf16 tensor-core peak, 989.5 TFLOP/s (NVIDIA datasheet).
# MFU 0.6: grouped GEMMs at MoE shapes reach ~55-65% of peak in DeepGEMM / Megatron-Core reports.
_H800 = dict(
    intra_bw=155e9,
    inter_bw=47e9,
    intra_latency=3e-6,
    inter_latency=10e-6,
    flops=989.5e12,
    mfu=0.6,
)

_PRESETS: dict[str, tuple[int, int]] = {
    "h800-4x8": (4, 8),  # 32 GPUs, the scale of the TopoEP paper's experiments
    "h800-2x8": (2, 8),
    "h800-8x8": (8, 8),
    "h800-32x8": (32, 8),  # 256 GPUs, an expert-parallel group of a DeepSeek-V3-class deployment
    # CPU-emulated meshes keep H800 link figures so that costs and metrics computed on them mean the
    # same thing as on the real cluster; only the shape differs.
    "cpu-1x8": (1, 8),
    "cpu-2x4": (2, 4),
    "cpu-4x2": (4, 2),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """Nodes x GPUs with two link classes. Bandwidths are bytes/s per GPU, one direction."""

    num_nodes: int
    gpus_per_node: int
    intra_bw: float = _H800["intra_bw"]
    inter_bw: float = _H800["inter_bw"]
    intra_latency: float = _H800["intra_latency"]
    inter_latency: float = _H800["inter_latency"]
    flops: float = _H800["flops"]
    mfu: float = _H800["mfu"]

    def __post_init__(self):
        for name in ("num_nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")
        for name in ("intra_bw", "inter_bw", "flops"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Topology.{name} must be > 0, got {value!r}")
        for name in ("intra_latency", "inter_latency"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"Topology.{name} must be >= 0, got {value!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Topology.mfu must be in (0, 1], got {self.mfu!r}")

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank):
        """Node index of a rank (int or integer array)."""
        return rank // self.gpus_per_node

    def link_cost(self) -> Float[np.ndarray, "R R"]:
        """Relative cost of moving one byte from rank s to rank d: 0 same rank, 1 same node,
        intra_bw / inter_bw across nodes (a byte on the slow link costs that many fast-link bytes)."""
        node = np.arange(self.num_ranks) // self.gpus_per_node
        same_node = node[:, None] == node[None, :]
        cost = np.where(same_node, 1.0, self.intra_bw / self.inter_bw).astype(np.float32)
        np.fill_diagonal(cost, 0.0)
        return cost

    @classmethod
    def preset(cls, name: str, **overrides) -> "Topology":
        if name not in _PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; known presets: {sorted(_PRESETS)}")
        nodes, gpus = _PRESETS[name]
        return cls(num_nodes=nodes, gpus_per_node=gpus, **{**_H800, **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)


def make_mesh(topology: Topology, data: int = 1, devices=None) -> Mesh:
    """A mesh with axes ("node", "gpu"), or ("data", "node", "gpu") when data > 1.

    Expert parallelism runs over ("node", "gpu"); "data" replicates experts across EP groups.
    """
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"data must be a positive int, got {data!r}")
    devices = jax.devices() if devices is None else list(devices)
    needed = data * topology.num_ranks
    if len(devices) < needed:
        raise ValueError(
            f"mesh needs data * num_nodes * gpus_per_node = {data} * {topology.num_nodes} * "
            f"{topology.gpus_per_node} = {needed} devices, but this process sees {len(devices)}; on CPU "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax"
        )
    grid = np.asarray(devices[:needed], dtype=object)
    if data == 1:
        return Mesh(grid.reshape(topology.num_nodes, topology.gpus_per_node), ("node", "gpu"))
    return Mesh(grid.reshape(data, topology.num_nodes, topology.gpus_per_node), ("data", "node", "gpu"))


EP_AXES = ("node", "gpu")
