"""What it would take to close the gap to `ideal`: the cluster projection under other assumptions.

python -m benchmarks.what_if [--model M ...] [--microbatches 2] [--keep-microbatches 4] [--sample-layers 4]

cluster.md says which term keeps topoep and taot short of 95% of `ideal`'s gain. This benchmark asks
whether a change that is plausible on a real cluster would close it, by re-pricing the same plans
under variants of the cost model (the planners themselves are unchanged; only `timing` differs):

- whole copies: the guest weights in one piece rather than the default slices of the hidden width
  (moe.guest_weight_chunks), so a guest GEMM waits for its whole copy; and in 8 slices.
- relayed weights: an inter-node copy travels as G stripes, home -> each GPU of its node (NVLink),
  -> the GPU with the same local index on the destination node (RDMA, all G rails at once) -> the
  guest host (NVLink), as NCCL's PXN and DeepEP route traffic; three exchanges one after another.
- weights behind the dispatch: a rank's guest weights also hide in the idle tail of its dispatch
  exchange (the exchange lasts as long as its busiest rank), which needs the weight fetch and the
  token exchange to run concurrently.
- weights relayed by a node peer: an inter-node copy leaves from the NIC of the rank on its home's
  node that has sent the least across nodes so far (the home itself on ties), after an NVLink hop
  from the home there, so a hot expert's home no longer sends every copy of it over its own NIC.
- chained weights: an expert's copies on other nodes travel along a chain, home -> first guest host
  -> next, each relay forwarding a slice of the weights as soon as it has it, so each NIC sends a
  copy once where a hot expert's home sends one per node (the pipelined broadcast of collective
  libraries); gradients come back along the chain, summed at each relay.
- inter-node copies at NVLink speed: an upper bound for any way of moving weights across nodes.
- gradients behind the rest of the backward pass: a guest copy's gradient is only needed by the
  optimizer step, so its return could overlap the backward of the layers below, not only this
  layer's home-slot backward; then only the weights going out count.
- weights and planning free: only the plan's GEMM and token exchange count.
- gradients of kept copies deferred: with copies kept between micro-batches, the gradients of a
  kept copy summed on its guest rank and sent home once, not every micro-batch. An upper bound: kept
  copies send no gradients at all.

And one change to the plans, not only their price: copies placed a micro-batch ahead. topoep
chooses each layer's copies on the previous micro-batch's loads of that layer, so their weights can
travel before the layer (during its attention), and this micro-batch's pairs are routed over those
copies; priced with the placement's latency on the critical path and off it.

It also searches for copies the planners do not make: into the free guest slots of topoep's plans, a
greedy search adds copies that serve one node's own pairs of an expert homed elsewhere, as long as
the cost model's layer time falls (sampled layers of one micro-batch). That asks whether the planner
leaves exchange time on the table. And on the same layers, the fastest routing of topoep's own copies
and quotas, from a linear program (best_routing): how much of the exchange gap is the routing rule's.

None of this is the cost model the planners and the headline projection use: these are questions,
with their answers in results/what_if.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cluster
from benchmarks.planners import pin_to_one_core, set_cpu_dispatch, time_call
from jtopoep import xla_cpu
from jtopoep.costmodel import (EXCHANGES_PER_LAYER, ExpertDims, copy_seconds_per_rank, exchange_seconds_per_rank,
                               exposed_weight_seconds, guest_copy_seconds, slot_forward_seconds,
                               ideal_layer_time, layer_time, link_class, shipped_guest_slots)
from jtopoep.plan import check_plan, home_plan
from jtopoep.planners import get_planner
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.topology import Topology

RESULTS = cluster.RESULTS
PLANNERS = ("topoep", "taot")


def _with_weights(times: dict, weights_s: float) -> dict:
    return {**times, "weights_s": weights_s, "total_s": times["total_s"] - times["weights_s"] + weights_s}


def _exposed(plan, topology, dims, placement, weights_out, grads_back) -> float:
    """costmodel.exposed_weight_seconds for per-rank transfer seconds other than the cost model's."""
    home_fwd, guest_fwd = slot_forward_seconds(plan, topology, dims, placement)
    return exposed_weight_seconds(weights_out, grads_back, home_fwd, guest_fwd, dims.weight_chunks)


def relayed_arrival_seconds(plan, topology: Topology, dims, placement, held=None) -> np.ndarray:
    """[R] seconds until the last guest weights a rank receives have arrived, with inter-node copies
    relayed over every rail (module docstring). Per stage, a rank is busy for the larger of what it
    sends and receives over that stage's link; a stripe passes a stage as fast as the busier of its
    two ranks, and the stages run one after another. Intra-node copies go directly in the first
    stage. A home rank sends a stripe to each GPU of its node once per expert, however many nodes
    get a copy (the reverse, for gradients, sums them there)."""
    gpus = topology.gpus_per_node
    ranks = topology.num_ranks
    guests = np.asarray(plan.slot_expert)[:, np.asarray(placement).shape[1]:]
    sender, shipped = shipped_guest_slots(plan, placement, held)
    spread, across, gather = (np.zeros((ranks, ranks)) for _ in range(3))  # stripes per stage
    spread_once = set()
    paths = []  # (guest host, the (rank, rank) pair of each stage a stripe passes)
    for d, i in zip(*np.nonzero(shipped)):
        h = sender[d, i]
        if h // gpus == d // gpus:
            spread[h, d] += gpus
            paths.append((d, [(h, d)]))
            continue
        for g in range(gpus):
            a, b = (h // gpus) * gpus + g, (d // gpus) * gpus + g
            if (guests[d, i], g) not in spread_once:
                spread_once.add((guests[d, i], g))
                spread[h, a] += a != h
            across[a, b] += 1
            gather[b, d] += b != d
            paths.append((d, [(h, a), (a, b), (b, d)]))
    stripe = dims.expert_bytes / gpus
    busy = [np.maximum(m.sum(0), m.sum(1)) * stripe / bw for m, bw in
            ((spread, topology.intra_bw), (across, topology.inter_bw), (gather, topology.intra_bw))]
    latency = [topology.intra_latency, topology.inter_latency, topology.intra_latency]
    arrival = np.zeros(ranks)
    for d, stages in paths:
        t = sum(max(busy[s][r] for r in pair) + latency[s] for s, pair in enumerate(stages))
        arrival[d] = max(arrival[d], t)
    return arrival


def relayed_weights(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Weights and gradients relayed over the rails; exposed where a guest host's last copy arrives
    after its home-slot GEMMs (relays and home ranks wait for nothing)."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    out = relayed_arrival_seconds(plan, topology, dims, placement, held)
    back = relayed_arrival_seconds(plan, topology, dims, placement)
    return _with_weights(times, _exposed(plan, topology, dims, placement, out, back))


def peer_relayed_seconds(plan, topology: Topology, dims, placement, held=None) -> np.ndarray:
    """[R] seconds until each rank's guest-weight transfers are done, with every inter-node copy sent
    across nodes by the rank of its home's node that has sent the fewest copies across nodes so far
    (the home on ties), in (guest host, slot) order, reached from the home over NVLink. Per link
    class a rank is busy for the larger of what it sends and receives, as
    costmodel.copy_seconds_per_rank prices it; a relayed copy reaches its host one NVLink slice
    (dims.weight_chunks) later, since a relay forwards each slice as soon as it has it. Gradients
    take the same path back."""
    gpus = topology.gpus_per_node
    sender, shipped = shipped_guest_slots(plan, placement, held)
    ranks = topology.num_ranks
    nvlink, across = np.zeros((ranks, ranks)), np.zeros((ranks, ranks))  # copies per (sender, receiver)
    sent_across = np.zeros(ranks, np.int64)
    relayed = np.zeros(ranks, bool)
    for d, i in zip(*np.nonzero(shipped)):
        h = sender[d, i]
        if h // gpus == d // gpus:
            nvlink[h, d] += 1
            continue
        peers = (h // gpus) * gpus + np.arange(gpus)
        fewest = sent_across[peers].min()
        relay = h if sent_across[h] == fewest else peers[np.argmax(sent_across[peers] == fewest)]
        if relay != h:
            nvlink[h, relay] += 1
            relayed[d] = True
        across[relay, d] += 1
        sent_across[relay] += 1
    busy = np.zeros(ranks)
    for moves, bandwidth in ((nvlink, topology.intra_bw), (across, topology.inter_bw)):
        busy = np.maximum(busy, np.maximum(moves.sum(0), moves.sum(1)) * dims.expert_bytes / bandwidth)
    return busy + np.where(relayed, dims.expert_bytes / topology.intra_bw / dims.weight_chunks, 0.0)


def peer_relayed_weights(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Inter-node copies sent across nodes by the least-used NIC of their home's node
    (peer_relayed_seconds)."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    out = peer_relayed_seconds(plan, topology, dims, placement, held)
    back = peer_relayed_seconds(plan, topology, dims, placement)
    return _with_weights(times, _exposed(plan, topology, dims, placement, out, back))


def chained_transfers(plan, topology: Topology, placement, held=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Guest copies with each expert's copies on other nodes sent along a chain: its home sends the
    weights to the first of them (in rank order), which forwards them to the next, and so on, each
    hop across nodes; copies on the home's own node come from the home. A rank that keeps its copy
    from the step's previous micro-batch (`held`) is left out of the chain (a simplification: it
    could start one). Returns ([R(sender), R(receiver)] copies sent, [R] the most hops before a
    rank's last copy arrives, [R] the most hops a rank's gradients wait for behind it in a chain:
    gradients go back along the chain, summed at each relay)."""
    gpus = topology.gpus_per_node
    guests = np.asarray(plan.slot_expert)[:, np.asarray(placement).shape[1]:]
    sender, shipped = shipped_guest_slots(plan, placement, held)
    ranks = topology.num_ranks
    moves = np.zeros((ranks, ranks), np.int64)
    hops_in, hops_back = np.zeros(ranks), np.zeros(ranks)
    chains = {}
    for d, i in zip(*np.nonzero(shipped)):
        h = sender[d, i]
        if h // gpus == d // gpus:
            moves[h, d] += 1
        else:
            chains.setdefault((guests[d, i], h), []).append(d)
    for (_, h), hosts in chains.items():
        path = [h] + sorted(hosts)
        for k in range(1, len(path)):
            moves[path[k - 1], path[k]] += 1
            hops_in[path[k]] = max(hops_in[path[k]], k - 1)
            hops_back[path[k - 1]] = max(hops_back[path[k - 1]], len(path) - 1 - k)
    return moves, hops_in, hops_back


def chained_weights(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Inter-node copies of an expert relayed along a chain of its guest hosts (chained_transfers):
    each rank's NIC sends a copy once, where the home of a hot expert sends one per node otherwise.
    The weights travel in dims.weight_chunks slices, so a relay forwards a slice as soon as it has
    it: each hop before a rank adds one slice's transfer time to when its last copy arrives, and
    likewise to when a rank's gradients have gone home through the hops behind it."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    slice_s = dims.expert_bytes / topology.inter_bw / dims.weight_chunks
    # Every copy's gradients go home, kept or not; the weights go out to the copies shipped.
    every, every_hops_in, hops_back = chained_transfers(plan, topology, placement)
    moves, hops_in = (every, every_hops_in) if held is None else chained_transfers(plan, topology, placement, held)[:2]
    out = copy_seconds_per_rank(moves, topology, dims) + hops_in * slice_s
    back = copy_seconds_per_rank(every, topology, dims) + hops_back * slice_s
    return _with_weights(times, _exposed(plan, topology, dims, placement, out, back))


def weights_behind_dispatch(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """A rank's transfers also hide in the time between its own dispatch ending and the busiest
    rank's (gradients likewise behind the backward exchange)."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    per_rank = exchange_seconds_per_rank(plan, topology, dims)
    idle_tail = per_rank.max() - per_rank
    out, back = guest_copy_seconds(plan, topology, dims, placement, held)
    return _with_weights(times, _exposed(plan, topology, dims, placement, out - idle_tail, back - idle_tail))


def copies_at_nvlink_speed(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Guest weights and gradients cross nodes at the NVLink bandwidth (tokens do not)."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    fast = dataclasses.replace(topology, inter_bw=topology.intra_bw)
    return _with_weights(times, layer_time(plan, fast, dims, placement, planning_s, held)["weights_s"])


def gradients_behind_backward(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Gradients going home are hidden; the weights going out are exposed as modelled."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    out, _ = guest_copy_seconds(plan, topology, dims, placement, held)
    return _with_weights(times, _exposed(plan, topology, dims, placement, out, np.zeros_like(out)))


def in_slices(chunks: int):
    """The cost model with the guest weights in `chunks` slices of the hidden width
    (moe.guest_weight_chunks = chunks) rather than the plans' dims' count; 1 is whole copies: a guest
    GEMM waits for its whole copy, and its gradients leave after the whole guest backward."""
    def timing(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
        return layer_time(plan, topology, dataclasses.replace(dims, weight_chunks=chunks), placement, planning_s,
                          held)
    return timing


whole_copies = in_slices(1)
in_eight_slices = in_slices(8)


def transfers_and_planning_free(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Only the plan's GEMM and token exchange count: what is left of the gap is the plan's balance."""
    times = layer_time(plan, topology, dims, placement, 0.0, held)
    return _with_weights(times, 0.0)


def kept_gradients_deferred(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
    """Copies kept from the previous micro-batch send no gradients in this one."""
    times = layer_time(plan, topology, dims, placement, planning_s, held)
    if held is None:
        return times
    shipped, _ = guest_copy_seconds(plan, topology, dims, placement, held)
    return _with_weights(times, _exposed(plan, topology, dims, placement, shipped, shipped))


FETCHED = {"as modelled": layer_time, "whole copies, not slices": whole_copies,
           "weights in 8 slices": in_eight_slices, "weights relayed over the rails": relayed_weights,
           "inter-node copies sent by a node peer": peer_relayed_weights,
           "inter-node copies relayed along a chain": chained_weights,
           "weights also behind the dispatch": weights_behind_dispatch,
           "inter-node copies at NVLink speed": copies_at_nvlink_speed,
           "gradients behind the rest of the backward": gradients_behind_backward,
           "weights and planning free": transfers_and_planning_free}
KEPT = {"copies kept, as modelled": layer_time, "copies kept, their gradients deferred": kept_gradients_deferred}


def add_locality_copies(counts, plan, topology: Topology, dims, placement, experts_per_node: int = 8):
    """Greedy search on the cost model: add the copy that lowers the layer time most, one at a time,
    each into a free guest slot of a node for one of that node's `experts_per_node` most-used experts
    homed elsewhere, taking all of that node's pairs of it (off its other slots, the fullest first),
    until no such copy helps. Returns (slot_expert, quota, layer seconds, copies added)."""
    placement = np.asarray(placement)
    ranks, home = placement.shape
    gpus, nodes = topology.gpus_per_node, topology.num_nodes
    experts = counts.shape[1]
    slot_expert = np.asarray(plan.slot_expert).copy()
    quota = np.asarray(plan.route).sum(0)
    best = layer_time(plan, topology, dims, placement)["total_s"]
    node_share = counts.reshape(nodes, gpus, experts).sum(1)
    home_node = np.arange(experts) // home // gpus
    added = 0
    while True:
        trials = []
        for n in range(nodes):
            on_node = slot_expert[n * gpus:(n + 1) * gpus]
            for e in np.argsort(-node_share[n], kind="stable")[:experts_per_node]:
                if home_node[e] == n or (on_node == e).any():
                    continue
                holders = sorted(zip(*np.nonzero(slot_expert == e)), key=lambda rs: -quota[rs])
                for d in range(n * gpus, (n + 1) * gpus):
                    free = np.nonzero(slot_expert[d, home:] < 0)[0]
                    if len(free) == 0:
                        continue
                    se, q = slot_expert.copy(), quota.copy()
                    se[d, home + free[0]] = e
                    q[d, home + free[0]] = left = int(node_share[n, e])
                    for r, s in holders:
                        take = min(left, q[r, s])
                        q[r, s] -= take
                        left -= take
                    candidate = plan_from_quotas(counts, se, q, gpus, True, np)
                    trials.append((layer_time(candidate, topology, dims, placement)["total_s"], se, q))
        if not trials:
            break
        seconds, se, q = min(trials, key=lambda t: t[0])
        if seconds >= best:
            break
        best, slot_expert, quota, added = seconds, se, q, added + 1
    return slot_expert, quota, best, added


@dataclasses.dataclass(frozen=True)
class SampledLayers:
    """topoep's plans (K = 2) on sampled layers of one micro-batch of a model, and ideal's times for
    those layers: what the copy search and the routing bound both start from, planned once."""
    dims: ExpertDims
    placement: np.ndarray
    layers: list[int]
    counts: list[np.ndarray]
    plans: list
    ideal: list[dict]  # costmodel.ideal_layer_time of each layer's home plan


def sample_layers(model: str, topology: Topology, num_layers: int) -> SampledLayers:
    cfg = cluster.load_model(model)
    dep = cluster.Deployment(cfg, topology.num_ranks)
    placement = np.arange(dep.num_experts).reshape(topology.num_ranks, -1)
    planner = jax.jit(get_planner("topoep", topology=topology, num_experts=dep.num_experts, guest_slots=2,
                                  dims=dep.dims))
    micro = cluster.model_traces(model, topology.num_ranks, 1, None)[0]
    layers = list(range(0, len(micro), max(1, len(micro) // num_layers)))[:num_layers]
    counts = [dep.expand(micro[layer]) for layer in layers]
    plans = [jax.device_get(planner(c)) for c in counts]
    ideal = [ideal_layer_time(home_plan(jnp.asarray(c), jnp.asarray(placement), 0), topology, dep.dims)
             for c in counts]
    return SampledLayers(dep.dims, placement, layers, counts, plans, ideal)


def locality_search(sample: SampledLayers, topology: Topology) -> dict:
    total = {"topoep_s": 0.0, "searched_s": 0.0, "ideal_s": 0.0, "copies_added": 0}
    for counts, plan, ideal in zip(sample.counts, sample.plans, sample.ideal):
        _, _, seconds, added = add_locality_copies(counts, plan, topology, sample.dims, sample.placement)
        total["topoep_s"] += layer_time(plan, topology, sample.dims, sample.placement)["total_s"]
        total["searched_s"] += seconds
        total["ideal_s"] += ideal["total_s"]
        total["copies_added"] += added
    return {**total, "layers": sample.layers}


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


def routing_bound(sample: SampledLayers, topology: Topology) -> dict:
    """topoep's exchange against best_routing's and ideal's on the sampled layers (ms of the four
    exchanges of those layers, with latency), and the pairs each sends across nodes."""
    across = link_class(topology) == 2
    total = {"topoep_s": 0.0, "best_s": 0.0, "ideal_s": 0.0, "topoep_inter_pairs": 0.0, "best_inter_pairs": 0.0}
    for counts, plan, ideal in zip(sample.counts, sample.plans, sample.ideal):
        seconds, route = best_routing(plan, counts, topology, sample.dims)
        total["topoep_s"] += layer_time(plan, topology, sample.dims, sample.placement)["exchange_s"]
        total["best_s"] += EXCHANGES_PER_LAYER * (seconds + topology.inter_latency)
        total["ideal_s"] += ideal["exchange_s"]
        total["topoep_inter_pairs"] += float(np.asarray(plan.route).sum(2)[across].sum())
        total["best_inter_pairs"] += float(route.sum(2)[across].sum())
    return {**total, "layers": sample.layers}


def rescaled_quotas(slot_expert, planned_quota, loads, home_slots: int) -> np.ndarray:
    """int32 [R, S] quotas for slot contents planned on other loads: each guest slot takes the share
    of its expert's load it was planned to take (floored, exactly: int64), and the home slot the
    rest, so every pair lands. slot_expert, planned_quota: [R, S] of the plan made ahead; loads:
    [E] this micro-batch's."""
    slot_expert = np.asarray(slot_expert)
    planned = np.asarray(planned_quota).astype(np.int64)
    loads = np.asarray(loads).astype(np.int64)
    held = slot_expert >= 0
    safe = np.maximum(slot_expert, 0)
    planned_load = np.bincount(safe[held], planned[held], minlength=loads.size).astype(np.int64)
    guest = held & (np.arange(slot_expert.shape[1]) >= home_slots)[None, :]
    share = np.where(guest, planned * loads[safe] // np.maximum(planned_load[safe], 1), 0)
    taken = np.bincount(safe[guest], share[guest], minlength=loads.size).astype(np.int64)
    quota = np.where(guest, share, np.where(held, loads[safe] - taken[safe], 0))
    return quota.astype(np.int32)


def routing_on_planned_copies(gpus_per_node: int):
    """jitted (counts, slot_expert, quota) -> the plan with those slot contents and quotas, routed as
    topoep routes (locality tiers, receive levelled)."""
    return jax.jit(lambda counts, slot_expert, quota: plan_from_quotas(counts, slot_expert, quota, gpus_per_node,
                                                                       True, jnp, level=True))


def weights_ahead(lead_s: float):
    """Guest weights fetched `lead_s` seconds before the layer's home GEMMs begin (the copies were
    chosen a micro-batch ahead, so their weights can travel during the layer's attention); their
    gradients go home as modelled."""
    def timing(plan, topology, dims, placement, planning_s=0.0, held=None) -> dict:
        times = layer_time(plan, topology, dims, placement, planning_s, held)
        out, back = guest_copy_seconds(plan, topology, dims, placement, held)
        home_fwd, guest_fwd = slot_forward_seconds(plan, topology, dims, placement)
        none = np.zeros_like(out)
        weights = (exposed_weight_seconds(out, none, home_fwd + lead_s, guest_fwd, dims.weight_chunks)
                   + exposed_weight_seconds(none, back, home_fwd, guest_fwd, dims.weight_chunks))
        return _with_weights(times, weights)
    return timing


AHEAD = ("copies planned ahead, as modelled", "and their weights fetched during the attention",
         "and the placement off the critical path")


def placed_ahead(model: str, topology: Topology, mats: np.ndarray, planning: dict, rounds: int = 50) -> dict:
    """topoep's copies chosen on the previous micro-batch's loads of the same layer (the first
    micro-batch's on the last one's, standing in for the previous step), this micro-batch's pairs
    routed over them (routing_on_planned_copies), under three prices: the copies' weights as
    modelled, and fetched during the layer's attention forward (weights_ahead), both with topoep's
    whole latency as the planning (the placement and this routing one after another on the device:
    the same stages topoep runs), and with only the routing's latency (the placement computed off
    the critical path, e.g. on a side stream while the previous micro-batch computes). Returns
    cluster.project-style rows for topoep under each, beside `none` and `ideal`, and the routing's
    latency (plan_from_quotas jitted, in this process: median of `rounds` calls; the rescaling, a
    few elementwise operations, is left out)."""
    cfg = cluster.load_model(model)
    dep = cluster.Deployment(cfg, topology.num_ranks)
    dims = dep.dims
    placement = np.arange(dep.num_experts).reshape(topology.num_ranks, -1)
    home = placement.shape[1]
    topoep = jax.jit(get_planner("topoep", topology=topology, num_experts=dep.num_experts, guest_slots=2,
                                 min_gain=0.0, dims=dims))
    route = routing_on_planned_copies(topology.gpus_per_node)
    non_moe = cluster.non_moe_seconds(cfg, topology)
    lead = non_moe / cfg.num_layers / 3.0  # one layer's non-MoE forward
    prices = dict(zip(AHEAD, ((layer_time, planning["topoep"]), (weights_ahead(lead), planning["topoep"]),
                              (weights_ahead(lead), None))))
    terms = ("gemm_s", "exchange_s", "weights_s", "planning_s")
    totals = {label: dict.fromkeys(terms, 0.0) for label in ("none", "ideal", *prices)}
    routing_s = None
    for m in range(len(mats)):
        for layer in range(mats.shape[1]):
            counts = dep.expand(mats[m, layer])
            ahead = jax.device_get(topoep(dep.expand(mats[m - 1, layer]), placement))
            quota = rescaled_quotas(ahead.slot_expert, np.asarray(ahead.route).sum(0), counts.sum(0), home)
            args = (jnp.asarray(counts), jnp.asarray(ahead.slot_expert), jnp.asarray(quota))
            plan = jax.device_get(route(*args))
            if routing_s is None:
                routing_s = time_call(lambda a: route(*a), args, rounds)
            check_plan(plan, counts, placement)
            for label, (timing, planning_s) in prices.items():
                t = timing(plan, topology, dims, placement, routing_s if planning_s is None else planning_s)
                for k in terms:
                    totals[label][k] += t[k]
            for label, t in (("none", layer_time(home_plan(counts, placement, 0), topology, dims, placement)),
                             ("ideal", ideal_layer_time(home_plan(jnp.asarray(counts), jnp.asarray(placement), 0),
                                                        topology, dims))):
                for k in terms:
                    totals[label][k] += t[k]
    rows = cluster.step_rows(totals, len(mats), non_moe, topology.num_ranks)
    return {"rows": rows, "routing_latency_s": routing_s}


def markdown(results: dict) -> str:
    lines = ["Projected share of `ideal`'s gain over `none` (weights term, ms per step) for the same plans "
             "under other cost-model assumptions (benchmarks/what_if.py says what each assumes). Not the "
             "cost model the planners and cluster.md use.", ""]
    for title, variants in (("Every copy fetched, K = 2", FETCHED),
                            (f"K = 2, {results['keep_microbatches']} micro-batches a step", KEPT)):
        lines += [f"### {title}", "", "| model | planner | " + " | ".join(variants) + " |",
                  "|---|---|" + "---|" * len(variants)]
        for model, rows in results["projections"].items():
            for name in PLANNERS:
                cells = [f"{100 * rows[v][name]['share_of_ideal_gain']:.0f}% ({1e3 * rows[v][name]['weights_s']:.1f})"
                         for v in variants]
                lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Copies the planner did not make (topoep, K = 2, sampled layers of one micro-batch)", "",
              "| model | layers | topoep ms | with searched copies ms | copies added | ideal ms |",
              "|---|---|---|---|---|---|"]
    for model, r in results["locality_search"].items():
        lines.append(f"| {model} | {len(r['layers'])} | {1e3 * r['topoep_s']:.2f} | {1e3 * r['searched_s']:.2f} | "
                     f"{r['copies_added']} | {1e3 * r['ideal_s']:.2f} |")
    lines += ["", "### Routing with topoep's copies and quotas fixed (K = 2, the same sampled layers)", "",
              "The exchange term of those layers (ms) under topoep's routing, under the routing a linear program "
              "finds fastest for the same slot contents and quotas (best_routing), and under ideal; and the "
              "pairs each sends across nodes.", "",
              "| model | topoep exchange ms | best routing ms | change | ideal ms | pairs across nodes: topoep, best |",
              "|---|---|---|---|---|---|"]
    for model, r in results["routing_bound"].items():
        lines.append(f"| {model} | {1e3 * r['topoep_s']:.2f} | {1e3 * r['best_s']:.2f} | "
                     f"{100 * (r['best_s'] / r['topoep_s'] - 1):+.1f}% | {1e3 * r['ideal_s']:.2f} | "
                     f"{r['topoep_inter_pairs']:,.0f}, {r['best_inter_pairs']:,.0f} |")
    lines += ["", "### Copies placed a micro-batch ahead (topoep, K = 2)", "",
              "topoep's copies chosen on the previous micro-batch's loads of each layer, this micro-batch's pairs "
              "routed over them with the planned shares rescaled to its loads (placed_ahead). Share of ideal's "
              "gain (weights ms, planning ms per step):", "",
              "| model | topoep as in cluster.md | " + " | ".join(AHEAD) + " | routing latency us |",
              "|---|---|" + "---|" * len(AHEAD) + "---|"]
    for model, r in results["placed_ahead"].items():
        base = results["projections"][model]["as modelled"]["topoep"]
        cells = [f"{100 * row['share_of_ideal_gain']:.0f}% ({1e3 * row['weights_s']:.1f}, {1e3 * row['planning_s']:.1f})"
                 for row in (base, *(r["rows"][label] for label in AHEAD))]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {1e6 * r['routing_latency_s']:.0f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--model", action="append", choices=cluster.MODELS, help="repeatable; default: all presets")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--keep-microbatches", type=int, default=4)
    parser.add_argument("--sample-layers", type=int, default=4,
                        help="layers per model in the copy search and the routing bound")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    # The routing latency placed_ahead() times is measured as the planner benchmark measures the
    # planners' (benchmarks.planners.HEADLINE_MODE): calls inline, every thread on one core.
    pin_to_one_core()
    set_cpu_dispatch(False)
    xla_cpu.configure()
    topology = Topology.preset(args.topology)
    latency = cluster.planning_latency(RESULTS / "planners.json")
    results = {"topology": args.topology, "keep_microbatches": args.keep_microbatches, "projections": {},
               "locality_search": {}, "routing_bound": {}, "placed_ahead": {}}
    for model in args.model or cluster.MODELS:
        mats = cluster.model_traces(model, topology.num_ranks, args.microbatches, None)
        step = cluster.model_traces(model, topology.num_ranks, args.keep_microbatches, None)
        rows = {}
        planning = cluster.deployment_latency(latency, model, topology.num_ranks, 2)
        for label, timing in FETCHED.items():
            rows[label] = cluster.project(model, topology, 2, planning, mats, 8, 0.0, timing=timing)
        for label, timing in KEPT.items():
            rows[label] = cluster.project(model, topology, 2, planning, step, 8, 0.0, keep_copies=True, timing=timing)
        results["projections"][model] = rows
        sample = sample_layers(model, topology, args.sample_layers)
        results["locality_search"][model] = locality_search(sample, topology)
        results["routing_bound"][model] = routing_bound(sample, topology)
        results["placed_ahead"][model] = placed_ahead(model, topology, mats, planning)
        print(model, "done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "what_if.json").write_text(json.dumps(results, indent=1))
    (args.out / "what_if.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
