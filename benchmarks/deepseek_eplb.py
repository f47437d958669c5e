"""DeepSeek's published expert-parallel load balancer (EPLB), written here in NumPy from its public
description, as the anchor the planners are measured against at scale.

It re-places every expert from (averaged) loads: `replicate` gives the R x S physical slots to the
experts, each extra replica to the expert with the most load per replica; `pack` deals the replicas
to ranks, heaviest first, each to the least-loaded rank with a free slot. The hierarchical policy
first packs groups of experts to nodes (so a token's group-limited experts stay on few nodes), then
replicates and packs within each node. Unlike jtopoep's planners it moves home experts, so it is a
periodic re-placement, not a per-micro-batch plan; its balance and host time are reported beside
theirs, not routed through the layer.
"""

from __future__ import annotations

import heapq

import numpy as np


def replicate(loads: np.ndarray, num_slots: int) -> np.ndarray:
    """int64 [E] replicas of each expert: one each, then every extra one to the expert with the
    largest load per replica (ties to the lowest index)."""
    num_experts = loads.shape[0]
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} physical slots cannot hold {num_experts} experts")
    replicas = np.ones(num_experts, np.int64)
    heap = [(-float(load), e) for e, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - num_experts):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-float(loads[e]) / replicas[e], e))
    return replicas


def pack(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """int64 [n] pack of each item, n a multiple of num_packs, each pack taking n / num_packs items:
    heaviest item first, to the lightest pack with room (ties to the lowest pack)."""
    per_pack = weights.shape[0] // num_packs
    if per_pack * num_packs != weights.shape[0]:
        raise ValueError(f"{weights.shape[0]} items do not divide into {num_packs} packs")
    pack_of = np.empty(weights.shape[0], np.int64)
    heap = [(0.0, p) for p in range(num_packs)]
    filled = np.zeros(num_packs, np.int64)
    for item in np.argsort(-weights, kind="stable"):
        load, p = heapq.heappop(heap)
        pack_of[item] = p
        filled[p] += 1
        if filled[p] < per_pack:
            heapq.heappush(heap, (load + float(weights[item]), p))
    return pack_of


def _packed_rank_loads(loads: np.ndarray, replicas: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-rank load [R] of the replicas packed over num_ranks ranks, each replica taking an equal
    share of its expert's load."""
    expert_of = np.repeat(np.arange(loads.shape[0]), replicas)
    share = loads[expert_of] / replicas[expert_of]
    rank_of = pack(share, num_ranks)
    return np.bincount(rank_of, weights=share, minlength=num_ranks)


def global_policy(loads: np.ndarray, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """float64 [R] rank loads under the global policy with slots_per_rank slots each."""
    return _packed_rank_loads(loads.astype(np.float64), replicate(loads.astype(np.float64), num_ranks * slots_per_rank),
                     num_ranks)


def hierarchical_policy(loads: np.ndarray, num_nodes: int, gpus_per_node: int, slots_per_rank: int,
                        num_groups: int) -> np.ndarray:
    """float64 [R] rank loads under the hierarchical policy: contiguous groups of experts packed to
    nodes, then each node's experts replicated into its G x S slots and packed to its GPUs.
    num_groups must be a multiple of num_nodes."""
    loads = loads.astype(np.float64)
    if num_groups % num_nodes or loads.shape[0] % num_groups:
        raise ValueError(f"{num_groups} groups must divide {loads.shape[0]} experts and be a multiple of "
                         f"{num_nodes} nodes")
    group_of = np.arange(loads.shape[0]) // (loads.shape[0] // num_groups)
    node_of_group = pack(np.bincount(group_of, weights=loads, minlength=num_groups), num_nodes)
    rank_loads = []
    for node in range(num_nodes):
        mine = loads[node_of_group[group_of] == node]
        rank_loads.append(_packed_rank_loads(mine, replicate(mine, gpus_per_node * slots_per_rank), gpus_per_node))
    return np.concatenate(rank_loads)
