"""Analytic forward+backward time of one MoE layer under a plan on a topology.

  time = GEMM (slowest rank) + token exchange (4 exchanges: dispatch and combine, forward and backward)
       + guest-weight transfer not hidden behind home-slot GEMMs + planning

Constants and their sources:
- SwiGLU expert: 3 matrices of D x F; 2 FLOPs per multiply-add, so 6 D F FLOPs per (token, expert)
  pair forward; backward computes input and weight gradients, twice the forward: 18 D F in all.
- A pair moves D elements four times per layer: dispatch and combine forward, and their transposes
  in the backward pass.
- A guest copy receives 3 D F weight elements before its forward GEMM and sends as many gradient
  elements home after its backward GEMM (gradients kept in the weight dtype, as Megatron-Core does
  for bf16 expert-parallel gradient reduction). A copy kept from the step's previous micro-batch
  (`held`) receives nothing; its gradients still go home.
- Guest weights travel in dims.weight_chunks slices of the hidden width F, one after another, and
  each slice's GEMM starts as soon as it has landed (jtopoep.guests); in the backward pass each
  slice's gradients leave as soon as its backward is done. Transfers hide behind the home-slot GEMMs
  and behind the guest GEMMs of the slices already there (exposed_weight_seconds).
- Links: the scale-up and scale-out fabrics are separate hardware and DeepEP drives them concurrently,
  so a rank's exchange time is the slower of its NVLink and RDMA transfers, sending and receiving in
  full duplex; each exchange pays the latency of the slowest link class it uses. The guest fetch's
  exchanges run one after another for each slice (jtopoep.guests: hand-offs, a home's own node,
  crossings, relays), each paying its latency (fetch_latency_seconds); their bytes are priced as one
  exchange: optimistic where a rank moves much over both link classes.
- Compute runs at topology.flops x topology.mfu.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jtopoep.plan import Plan, fetch_send_rows, guest_fetch, home_rank_of_experts
from jtopoep.topology import Topology

EXCHANGES_PER_LAYER = 4  # dispatch + combine, forward + backward


@dataclasses.dataclass(frozen=True)
class ExpertDims:
    d_model: int  # D
    expert_hidden: int  # F
    bytes_per_element: int = 2  # bf16
    # Guest weights move in this many slices of F, each computed as it lands (MoEConfig.guest_weight_chunks).
    weight_chunks: int = 1

    def __post_init__(self):
        if self.weight_chunks < 1 or self.expert_hidden % self.weight_chunks:
            raise ValueError(f"weight_chunks = {self.weight_chunks} must be a positive divisor of expert_hidden = "
                             f"{self.expert_hidden}")

    @classmethod
    def from_model(cls, model) -> "ExpertDims":
        return cls(model.d_model, model.expert_hidden, model.element_bytes)

    @property
    def pair_flops(self) -> float:
        """Forward + backward FLOPs of one (token, expert) pair through a SwiGLU expert."""
        return 18.0 * self.d_model * self.expert_hidden

    @property
    def pair_bytes(self) -> float:
        """Bytes of one pair's activation in one exchange."""
        return float(self.d_model * self.bytes_per_element)

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert's weights (gate, up, down)."""
        return 3.0 * self.d_model * self.expert_hidden * self.bytes_per_element


def copy_break_even_pairs(topology: Topology, dims: ExpertDims) -> tuple[float, float]:
    """Pairs a guest copy must take off its home rank for the GEMM time saved to equal the time of
    shipping its weights out and its gradients back, on an (intra-node, inter-node) link."""
    per_pair = dims.pair_flops / (topology.flops * topology.mfu)
    moved = 2.0 * dims.expert_bytes
    return moved / topology.intra_bw / per_pair, moved / topology.inter_bw / per_pair


def crossing_break_even_pairs(dims: ExpertDims) -> float:
    """Pairs whose token exchanges across nodes carry as many bytes as one guest copy's weights out
    and gradients back: a copy on a node pays in scale-out bytes when it keeps more of them there."""
    return 2.0 * dims.expert_bytes / (EXCHANGES_PER_LAYER * dims.pair_bytes)


def link_class(topology: Topology) -> np.ndarray:
    """0 same rank, 1 same node, 2 across nodes, as an [R, R] array."""
    node = np.arange(topology.num_ranks) // topology.gpus_per_node
    same_node = node[:, None] == node[None, :]
    cls = np.where(same_node, 1, 2)
    np.fill_diagonal(cls, 0)
    return cls


def home_rank_of_slots(plan: Plan, placement: np.ndarray) -> np.ndarray:
    """[R, S] home rank of the expert in each slot (-1 for empty slots)."""
    home_of_expert = home_rank_of_experts(np.asarray(placement), np)
    slot_expert = np.asarray(plan.slot_expert)
    return np.where(slot_expert >= 0, home_of_expert[np.maximum(slot_expert, 0)], -1)


def shipped_guest_slots(plan: Plan, placement, held=None) -> tuple[np.ndarray, np.ndarray]:
    """([R, K] home rank of each guest slot's expert, -1 empty; [R, K] whether its weights are
    shipped). held: [R, K'] guest experts each rank already holds (the previous micro-batch's guest
    columns of the same step, -1 empty); copies of those are kept, not shipped (jtopoep.guests)."""
    home = np.asarray(placement).shape[1]
    guests = np.asarray(plan.slot_expert)[:, home:]
    home_rank = home_rank_of_slots(plan, np.asarray(placement))[:, home:]
    shipped = home_rank >= 0
    if held is not None:
        held = np.asarray(held)
        shipped &= ~(guests[:, :, None] == held[:, None, :]).any(2)
    return home_rank, shipped


def guest_transfers(plan: Plan, placement: np.ndarray, gpus_per_node: int, held=None) -> np.ndarray:
    """[R(sender), R(receiver)] number of guest copies each rank sends each rank under the fan-out
    fetch (plan.guest_fetch: each expert crosses once to each node holding copies, the crossings
    spread over the scale-out links at both ends with NVLink hops to and from them; relays pass
    copies on over NVLink); held: as shipped_guest_slots. Gradients travel the same links back."""
    home_rank, shipped = shipped_guest_slots(plan, placement, held)
    home = np.asarray(placement).shape[1]
    guests = np.asarray(plan.slot_expert)[:, home:]
    fetch = guest_fetch(guests, np.asarray(placement), gpus_per_node, shipped, np)
    num_ranks = home_rank.shape[0]
    moves = np.zeros((num_ranks, num_ranks), np.int64)
    np.add.at(moves, (fetch.source[shipped], np.nonzero(shipped)[0]), 1)
    peer, _ = np.nonzero(fetch.staged >= 0)
    np.add.at(moves, (home_rank_of_experts(np.asarray(placement), np)[fetch.staged[fetch.staged >= 0]], peer), 1)
    relay, _ = np.nonzero(fetch.received >= 0)
    np.add.at(moves, (fetch.received_from[fetch.received >= 0], relay), 1)
    np.fill_diagonal(moves, 0)  # a relay that holds the expert itself takes it from its own row
    return moves


def exchange_seconds_per_rank(plan: Plan, topology: Topology, dims: ExpertDims) -> np.ndarray:
    """[R] seconds of one token exchange at each rank: the slower of its NVLink and RDMA transfers,
    each the larger of what it sends and receives (full duplex), without latency."""
    pairs = np.asarray(plan.route).astype(np.float64).sum(axis=2)  # [s, d]
    cls = link_class(topology)
    bw = {1: topology.intra_bw, 2: topology.inter_bw}
    per_rank = np.zeros(pairs.shape[0])
    for c in (1, 2):
        sent = np.where(cls == c, pairs, 0.0)
        per_rank = np.maximum(per_rank, np.maximum(sent.sum(1), sent.sum(0)) * dims.pair_bytes / bw[c])
    return per_rank


def relay_exchange_seconds_per_rank(plan: Plan, node_rows: np.ndarray, topology: Topology,
                                    dims: ExpertDims) -> np.ndarray:
    """[R] seconds of one token exchange at each rank with the hierarchical dispatch (jtopoep.relay):
    stage 1 over the scale-out link, each token once to every other node it reaches (node_rows
    [R, N]: distinct (token, node) rows from each source to each node), to the GPU of the sender's
    index; then stage 2 over NVLink, each relay's pairs to the other GPUs of its node. The stages
    run one after the other; each the larger of what a rank sends and receives."""
    rows = np.asarray(node_rows).astype(np.float64)
    num_ranks, num_nodes = rows.shape
    gpus = topology.gpus_per_node
    own = np.arange(num_ranks) // gpus
    across = np.where(own[:, None] != np.arange(num_nodes)[None, :], rows, 0.0)  # [s, n]
    grid = across.reshape(num_nodes, gpus, num_nodes)  # [n', g, n]: to relay (n, g)
    received = grid.sum(0).T.reshape(-1)  # relay (n, g)
    stage1 = np.maximum(across.sum(1), received) * dims.pair_bytes / topology.inter_bw
    pairs = np.asarray(plan.route).astype(np.float64).sum(2).reshape(num_nodes, gpus, num_nodes, gpus)
    forwarded = pairs.sum(0)  # [g0, n, g']: relay (n, g0) to rank (n, g')
    off_rank = 1.0 - np.eye(gpus)[:, None, :]
    sent = (forwarded * off_rank).sum(2).T.reshape(-1)  # relay (n, g0)
    got = (forwarded * off_rank).sum(0).reshape(-1)  # rank (n, g')
    stage2 = np.maximum(sent, got) * dims.pair_bytes / topology.intra_bw
    return stage1 + stage2


def copy_seconds_per_rank(moves: np.ndarray, topology: Topology, dims: ExpertDims) -> np.ndarray:
    """[R] seconds of copy transfers at each rank, moves [R(home), R(guest host)] copies: home ranks
    send (rows), guest hosts receive (columns); per link class, full duplex: the slower side."""
    cls = link_class(topology)
    out = np.zeros(moves.shape[0])
    for c, bw in ((1, topology.intra_bw), (2, topology.inter_bw)):
        m = np.where(cls == c, moves.astype(np.float64), 0.0) * dims.expert_bytes / bw
        out = np.maximum(out, np.maximum(m.sum(0), m.sum(1)))
    return out


def guest_copy_seconds(plan: Plan, topology: Topology, dims: ExpertDims, placement,
                       held=None) -> tuple[np.ndarray, np.ndarray]:
    """([R] seconds of guest weights going out, [R] seconds of guest gradients coming back) at each
    rank: copies held already ship no weights, but every copy's gradients go home."""
    placement = np.asarray(placement)
    every_copy = copy_seconds_per_rank(guest_transfers(plan, placement, topology.gpus_per_node), topology, dims)
    if held is None:
        return every_copy, every_copy
    return (copy_seconds_per_rank(guest_transfers(plan, placement, topology.gpus_per_node, held), topology, dims),
            every_copy)


def slot_forward_seconds(plan: Plan, topology: Topology, dims: ExpertDims, placement) -> tuple[np.ndarray, np.ndarray]:
    """([R] seconds of each rank's home-slot forward GEMMs, [R] of its guest-slot forward GEMMs)."""
    home = np.asarray(placement).shape[1]
    per_rank_slot = np.asarray(plan.route).astype(np.float64).sum(axis=0)  # [d, S]
    per_pair = dims.pair_flops / 3.0 / (topology.flops * topology.mfu)
    return per_rank_slot[:, :home].sum(1) * per_pair, per_rank_slot[:, home:].sum(1) * per_pair


def fetch_latency_seconds(plan: Plan, topology: Topology, placement) -> float:
    """Latency one slice of the guest fetch pays, each way: its exchanges one after another
    (plan.fetch_send_rows: hand-offs, a home's own node, crossings, relays; those a topology has), each
    at the latency of the slowest link class it uses: NVLink, but the crossings' scale-out where a
    copy crosses nodes; 0 without copies."""
    placement = np.asarray(placement)
    guests = np.asarray(plan.slot_expert)[:, placement.shape[1]:]
    if not (guests >= 0).any():
        return 0.0
    gpus = topology.gpus_per_node
    hands, local, crossing, relays = fetch_send_rows(topology.num_ranks, placement.shape[1], guests.shape[1], gpus)
    home_node = home_rank_of_experts(placement, np)[guests[guests >= 0]] // gpus
    crosses = (home_node != np.nonzero(guests >= 0)[0] // gpus).any()
    over_nvlink = sum(rows > 0 for rows in (hands, local, relays)) + (crossing > 0 and not crosses)
    return over_nvlink * topology.intra_latency + (topology.inter_latency if crosses else 0.0)


def exposed_weight_seconds(weights_out: np.ndarray, grads_back: np.ndarray, home_fwd: np.ndarray,
                           guest_fwd: np.ndarray, chunks: int = 1, slice_latency: float = 0.0) -> float:
    """The guest-weight term from per-rank seconds: weight transfers out, gradient transfers back,
    home-slot and guest-slot forward GEMMs; the most exposed rank of each direction counts.

    Forward: the home GEMMs run first; the weights land in n = `chunks` equal slices one after
    another, and the guest GEMM of slice j starts once it has landed and slice j - 1's is done. The
    last one ends late by the most any slice's arrival is late for it: max over j of
    ((j + 1) out - j g) / n - home, g the guest GEMMs. Backward: the guest slices' backward runs first
    (twice the forward), and a slice's gradients leave when it is done, after the slices before it on
    the link; the last arrives late by max over j of ((n - j) back - (n - 1 - j) 2 g) / n - 2 home.
    With one chunk these are the whole copy behind the home GEMMs, out - home, and the gradients
    behind the home backward, back - 2 home. slice_latency (fetch_latency_seconds): what each slice's
    exchanges add before it lands, on the ranks that move anything or wait for a copy (a kept copy
    passes through the same exchanges), so slice j lands (j + 1) latencies later, and slice j's
    gradients n - j later."""
    j = np.arange(chunks, dtype=np.float64)[:, None]
    out_latency = np.where((weights_out > 0) | (guest_fwd > 0), slice_latency, 0.0)
    back_latency = np.where(grads_back > 0, slice_latency, 0.0)
    forward = (((j + 1) * weights_out - j * guest_fwd) / chunks + (j + 1) * out_latency).max(0) - home_fwd
    backward = (((chunks - j) * grads_back - (chunks - 1 - j) * 2.0 * guest_fwd) / chunks
                + (chunks - j) * back_latency).max(0) - 2.0 * home_fwd
    return float(np.maximum(forward, 0.0).max() + np.maximum(backward, 0.0).max())


def layer_time(plan: Plan, topology: Topology, dims: ExpertDims, placement,
               planning_s: float = 0.0, held=None, node_rows=None) -> dict[str, float]:
    """Seconds of one MoE layer's forward+backward under the plan, by term, and their sum.

    placement: [R, H] home expert of each home slot (the plan's first H slot columns).
    held: [R, K'] guest experts each rank kept from the step's previous micro-batch (-1 empty): their
    copies' weights are not shipped again, but every copy's gradients still go home.
    node_rows: [R, N] distinct (token, node) rows each source sends each node, for the hierarchical
    dispatch (relay_exchange_seconds_per_rank); None prices the flat exchange of every pair."""
    route = np.asarray(plan.route).astype(np.float64)
    placement = np.asarray(placement)
    gemm = float(route.sum(axis=(0, 2)).max() * dims.pair_flops / (topology.flops * topology.mfu))

    cls = link_class(topology)
    pairs = route.sum(axis=2)  # [s, d]
    uses_inter = bool((np.where(cls == 2, pairs, 0) > 0).any())
    uses_intra = bool((np.where(cls == 1, pairs, 0) > 0).any())
    latency = topology.inter_latency if uses_inter else (topology.intra_latency if uses_intra else 0.0)
    per_rank = (exchange_seconds_per_rank(plan, topology, dims) if node_rows is None
                else relay_exchange_seconds_per_rank(plan, node_rows, topology, dims))
    exchange = EXCHANGES_PER_LAYER * (float(per_rank.max()) + latency)

    weights_out, grads_back = guest_copy_seconds(plan, topology, dims, placement, held)
    home_fwd, guest_fwd = slot_forward_seconds(plan, topology, dims, placement)
    weights = exposed_weight_seconds(weights_out, grads_back, home_fwd, guest_fwd, dims.weight_chunks,
                                     fetch_latency_seconds(plan, topology, placement))

    total = gemm + exchange + weights + planning_s
    return {"gemm_s": gemm, "exchange_s": exchange, "weights_s": weights, "planning_s": planning_s,
            "total_s": total}


def ideal_layer_time(plan: Plan, topology: Topology, dims: ExpertDims, node_rows=None) -> dict[str, float]:
    """Perfect balance at no cost: the plan's pairs spread evenly over the ranks (ceil(sum / R)
    each, a bound on the GEMM term no planner can beat without moving home experts) and its token
    traffic of each link class spread evenly too, with no weight transfer and no planning. Given
    the home plan, the exchange term is not a bound: copies fed by their own node's pairs take
    traffic off the scale-out links, and a planner that places them so can beat it.
    node_rows: [R, N] as for layer_time, for the hierarchical dispatch: its scale-out rows and its
    relays' NVLink pairs, each stage spread evenly."""
    route = np.asarray(plan.route).astype(np.float64)
    num_ranks = route.shape[0]
    rate = topology.flops * topology.mfu
    gemm = float(np.ceil(route.sum() / num_ranks) * dims.pair_flops / rate)
    cls = link_class(topology)
    pairs = route.sum(axis=2)
    intra = pairs[cls == 1].sum() / num_ranks * dims.pair_bytes / topology.intra_bw
    inter = pairs[cls == 2].sum() / num_ranks * dims.pair_bytes / topology.inter_bw
    latency = topology.inter_latency if pairs[cls == 2].any() else (topology.intra_latency if pairs[cls == 1].any() else 0.0)
    spread = max(intra, inter)
    if node_rows is not None:
        even = np.full((num_ranks, topology.num_nodes), np.asarray(node_rows, np.float64).sum() / num_ranks / topology.num_nodes)
        spread = float(relay_exchange_seconds_per_rank(Plan(plan.slot_expert, np.full_like(route, route.mean())), even,
                                                       topology, dims).max())
    exchange = EXCHANGES_PER_LAYER * (spread + latency)
    return {"gemm_s": gemm, "exchange_s": exchange, "weights_s": 0.0, "planning_s": 0.0, "total_s": gemm + exchange}


# Bytes a migrated expert carries per weight element: float32 weights and AdamW's two float32 moments.
MIGRATED_BYTES_PER_ELEMENT = 12


def migration_seconds(old, new, topology: Topology, dims: ExpertDims, *,
                      state_bytes_per_element: int = MIGRATED_BYTES_PER_ELEMENT,
                      replace_every: int = 1) -> float:
    """Seconds one re-placement takes to move the home experts that change rank (jtopoep.migration),
    divided over the `replace_every` steps it serves. Each moved expert carries its float32 weights
    and AdamW's two float32 moments (state_bytes_per_element = 12 per weight element); the slowest
    rank's sends and receives over each link class bound it."""
    old_rank = home_rank_of_experts(np.asarray(old), np)
    new_rank = home_rank_of_experts(np.asarray(new), np)
    moved = old_rank != new_rank
    across = moved & (old_rank // topology.gpus_per_node != new_rank // topology.gpus_per_node)
    expert = 3.0 * dims.d_model * dims.expert_hidden * state_bytes_per_element
    seconds = np.zeros(topology.num_ranks)
    for ranks in (old_rank, new_rank):  # each rank's sends, then its receives
        seconds = np.maximum(seconds, np.bincount(ranks[moved & ~across], minlength=topology.num_ranks) * expert
                             / topology.intra_bw + np.bincount(ranks[across], minlength=topology.num_ranks) * expert
                             / topology.inter_bw)
    return float(seconds.max()) / replace_every
