"""The fastest routing of a plan's own copies and quotas, by a linear program: a reference the
routing tests hold the locality-tiered routing to (planners.routing)."""

from __future__ import annotations

import numpy as np

from benchmarks.loads import synthetic_families
from jtopoep.costmodel import ExpertDims, exchange_seconds_per_rank, link_class
from jtopoep.planners.eplb import even_quotas
from jtopoep.planners.eplb import eplb_slots
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.topology import Topology


def best_routing(plan, counts, topology: Topology, dims) -> tuple[float, np.ndarray]:
    """The routing of the plan's own copies and quotas with the fastest token exchange: a linear
    program over how many pairs each source sends to each copy of every expert with copies, that
    minimises the slowest rank's transfer time (either direction, either link class, as
    costmodel.exchange_seconds_per_rank prices it). Pairs of experts without copies go home as
    before. Returns (seconds of one exchange without latency, the route [s, d, S] as floats).

    An upper bound on what any routing rule could do for these slot contents and quotas (the
    integer routing can only be slower); it asks how much of the exchange gap is routing's."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    route = np.asarray(plan.route).astype(np.float64)
    slot_expert = np.asarray(plan.slot_expert).reshape(-1)
    num_ranks, _, num_slots = route.shape
    copies = np.bincount(slot_expert[slot_expert >= 0], minlength=counts.shape[1])
    free = np.nonzero((slot_expert >= 0) & (copies[np.maximum(slot_expert, 0)] > 1))[0]  # [n] slots
    if free.size == 0:
        return float(exchange_seconds_per_rank(plan, topology, dims).max()), route
    n = free.size
    flat = route.reshape(num_ranks, -1)
    fixed = flat.copy()
    fixed[:, free] = 0.0
    fixed = fixed.reshape(route.shape).sum(2)  # [s, d] pairs that stay as they are
    host = free // num_slots  # [n] rank of each free slot
    experts, expert_of = np.unique(slot_expert[free], return_inverse=True)
    cls = link_class(topology)
    per_pair = {1: dims.pair_bytes / topology.intra_bw, 2: dims.pair_bytes / topology.inter_bw}
    src = np.repeat(np.arange(num_ranks), n)  # variable s * n + j
    slot = np.tile(np.arange(n), num_ranks)
    var = np.arange(num_ranks * n)
    # Every slot takes its quota, and every source sends each such expert all its pairs.
    eq = coo_matrix((np.ones(2 * var.size), (np.concatenate([slot, n + expert_of[slot] * num_ranks + src]),
                                             np.concatenate([var, var]))),
                    shape=(n + experts.size * num_ranks, var.size + 1))
    b_eq = np.concatenate([flat[:, free].sum(0), counts[:, experts].T.reshape(-1)])
    # Rows (class c, send / receive, rank): k_c x (variable pairs + fixed pairs) <= t.
    rows, cols, vals, b_ub = [], [], [], []
    link = cls[src, host[slot]]
    for i, c in enumerate((1, 2)):
        on = link == c
        rows += [(2 * i) * num_ranks + src[on], (2 * i + 1) * num_ranks + host[slot[on]]]
        cols += [var[on], var[on]]
        vals += [np.full(on.sum(), per_pair[c])] * 2
        mine = np.where(cls == c, fixed, 0.0)
        b_ub += [-per_pair[c] * mine.sum(1), -per_pair[c] * mine.sum(0)]
    rows.append(np.arange(4 * num_ranks))
    cols.append(np.full(4 * num_ranks, var.size))
    vals.append(-np.ones(4 * num_ranks))
    ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                    shape=(4 * num_ranks, var.size + 1))
    objective = np.zeros(var.size + 1)
    objective[-1] = 1.0
    result = linprog(objective, A_ub=ub.tocsr(), b_ub=np.concatenate(b_ub), A_eq=eq.tocsr(), b_eq=b_eq,
                     bounds=(0, None), method="highs")
    if result.status != 0:
        raise RuntimeError(f"the routing program did not solve: {result.message}")
    best = flat.copy()
    best[:, free] = result.x[:-1].reshape(num_ranks, n)
    return float(result.x[-1]), best.reshape(route.shape)


def eplb_plan_on_zipf():
    """(topology, dims, counts, placement, eplb's plan) on a skewed load: h800-2x8, E = 32, K = 2,
    eplb's slots with even quotas and topology-oblivious routing (many inter-node copies); guest
    weights in two slices."""
    topology = Topology.preset("h800-2x8")
    dims = ExpertDims(d_model=2048, expert_hidden=1408, weight_chunks=2)
    counts = synthetic_families(16, 32, 512, steps=1)["zipf-1.0"][0]
    placement = np.arange(32).reshape(16, 2)
    slot_expert, _ = eplb_slots(counts, placement, 2, 0.0, np)
    plan = plan_from_quotas(counts, slot_expert, even_quotas(slot_expert, counts.sum(0), np), 8, False, np)
    return topology, dims, counts, placement, plan
