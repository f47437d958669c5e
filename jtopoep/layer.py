"""Flax NNX MoE layer: router + expert-parallel dispatch with a balancing planner.

Expert weights are sharded over the ("node", "gpu") mesh axes on their expert dimension; tokens are
sharded over every mesh axis. The layer runs router and dispatch inside one shard_map, and returns
its output with per-layer statistics, all device values (no host sync).

Precision: the layer computes in its input's dtype. Expert weights (float32 parameters) are cast to it
before the dispatch, so with bfloat16 activations the token exchange, the guest-weight transfers and
their gradients all move bfloat16, as the cost model prices them. The router's logits, top-k and
gates are computed in float32 whatever the input, so that expert choice does not hinge on bfloat16
rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Real

from jtopoep.config import MoEConfig
from jtopoep.costmodel import ExpertDims
from jtopoep.dispatch import moe_dispatch, receive_rows
from jtopoep.gemm import resolve_weight_chunks
from jtopoep.guests import ExpertWeights, GuestCopies, kept_slots
from jtopoep.homes import coactivation
from jtopoep.metrics import counts_imbalance, load_imbalance
from jtopoep.plan import contiguous_placement, plan_fingerprint
from jtopoep.planners import PLANNERS, get_planner
from jtopoep.router import route
from jtopoep.topology import EP_AXES, Topology


class ExpertParam(nnx.Param):
    """A parameter whose leading axis is the expert axis, sharded over ("node", "gpu")."""


class RouterBias(nnx.Variable):
    """Non-trained routing bias for auxiliary-loss-free balancing, updated in the train step."""


class Placement(nnx.Variable):
    """i32[R, H]: the logical expert in each home slot, replicated; the expert weights (and their
    optimizer moments) are stored in this order. Changed only by a re-placement (jtopoep.migration)."""


class RoutingAverage(nnx.Variable):
    """An exponential moving average of routing statistics the re-placement reads (not trained)."""


def make_planner(moe: MoEConfig, topology: Topology, num_experts: int, dims: ExpertDims):
    """The planner moe.planner names, with the knobs its class takes from the run file."""
    knobs = {field: getattr(moe, key) for field, key in PLANNERS[moe.planner].config_keys.items()}
    return get_planner(moe.planner, topology=topology, num_experts=num_experts, guest_slots=moe.planned_guest_slots,
                       dims=dims, **knobs)


class MoELayer(nnx.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, expert_hidden: int, moe: MoEConfig,
                 topology: Topology, mesh: Mesh, *, dtype=jnp.float32, rngs: nnx.Rngs):
        """dtype: the compute dtype the layer will see; it sets the bytes per element the planner's
        cost model prices transfers with."""
        if num_experts % topology.num_ranks:
            raise ValueError(f"num_experts = {num_experts} must be a multiple of the {topology.num_ranks} ranks")
        if moe.guest_weight_chunks and expert_hidden % moe.guest_weight_chunks:
            raise ValueError(f"moe.guest_weight_chunks = {moe.guest_weight_chunks} must be 0 (by moe.gemm) or a "
                             f"divisor of expert_hidden = {expert_hidden}")
        # The slices the guest weights travel in (0: by the grouped GEMM this backend runs).
        self.weight_chunks = resolve_weight_chunks(moe.guest_weight_chunks, moe.gemm, expert_hidden)
        self.moe = moe
        self.dtype = jnp.dtype(dtype)
        self.top_k = top_k
        self.topology = topology
        self.mesh = mesh
        dims = ExpertDims(d_model, expert_hidden, jnp.dtype(dtype).itemsize, self.weight_chunks)
        self.planner = make_planner(moe, topology, num_experts, dims)
        init = nnx.initializers.normal(stddev=d_model ** -0.5)
        self.router = nnx.Param(init(rngs.params(), (d_model, num_experts)))
        self.w_gate = ExpertParam(init(rngs.params(), (num_experts, d_model, expert_hidden)))
        self.w_up = ExpertParam(init(rngs.params(), (num_experts, d_model, expert_hidden)))
        self.w_down = ExpertParam(nnx.initializers.normal(stddev=expert_hidden ** -0.5)(
            rngs.params(), (num_experts, expert_hidden, d_model)))
        self.bias = RouterBias(jnp.zeros(num_experts)) if moe.bias_balancing else None
        self.placement = Placement(contiguous_placement(topology.num_ranks, num_experts))
        if moe.replace_every:
            self.load_average = RoutingAverage(jnp.zeros(num_experts))
            self.coactivation_average = RoutingAverage(jnp.zeros((num_experts, num_experts)))
        else:
            self.load_average = self.coactivation_average = None

    @property
    def tracks_routing(self) -> bool:
        """Whether the layer keeps the averages a re-placement reads (moe.replace_every > 0)."""
        return self.load_average is not None

    def observe(self, loads: Real[Array, "*layers E"], coactivations: Real[Array, "*layers E E"]) -> None:
        """Fold one step's loads and co-activation counts into the averages (moe.load_decay); with
        the layer's variables stacked over layers, each layer's own [layers, ...]."""
        decay = self.moe.load_decay
        for average, value in ((self.load_average, loads), (self.coactivation_average, coactivations)):
            average.set_value(decay * average.get_value() + (1 - decay) * value.astype(jnp.float32))

    def recv_rows(self, tokens_per_rank: int) -> int:
        """Rows of each rank's receive buffer for T tokens per rank (moe.recv_capacity_factor)."""
        return receive_rows(self.moe.recv_capacity_factor, tokens_per_rank * self.top_k, self.topology.num_ranks)

    @property
    def makes_copies(self) -> bool:
        """Whether this layer's plans can have guest copies (so it has GuestCopies to keep)."""
        return self.moe.planned_guest_slots > 0

    def no_guest_copies(self) -> GuestCopies:
        """The copies held before a step's first micro-batch: none. Held copies are per device
        (experts [devices, R, K], weights [devices * K, ...], both sharded over every mesh axis):
        expert-parallel groups side by side on a "data" axis plan their own copies."""
        devices, num_ranks, slots = self.mesh.size, self.topology.num_ranks, self.moe.guest_slots
        return GuestCopies(jnp.full((devices, num_ranks, slots), -1, jnp.int32),
                           ExpertWeights(*(jnp.zeros((devices * slots,) + w.shape[1:], self.dtype)
                                           for w in (self.w_gate, self.w_up, self.w_down))))

    def __call__(self, x: Float[Array, "B L D"],
                 previous: GuestCopies | None = None) -> tuple[Float[Array, "B L D"], dict]:
        """y and this layer's stats (losses, imbalance, inter-node pairs, counts, guest copies made and
        kept, pairs dropped). previous: the guest copies this layer held after the previous
        micro-batch of the same optimizer step (stats["guests"] of that call; no_guest_copies() for
        the first); copies held again are not fetched (jtopoep.guests). With it, stats["guests"] holds
        the copies after this call, for the next micro-batch."""
        batch_axes = tuple(a for a in self.mesh.axis_names)
        token_spec = P(batch_axes)
        expert_spec = P(EP_AXES)
        moe = self.moe
        tracks = self.tracks_routing
        bias = None if self.bias is None else self.bias.get_value()
        keep = previous is not None
        if keep and not self.makes_copies:
            raise ValueError(f"previous guest copies were passed to a layer that makes none (planner "
                             f"{moe.planner!r}, guest_slots {moe.guest_slots})")

        def body(x, router, w_gate, w_up, w_down, bias, previous, placement):
            b, length, d = x.shape
            if keep:
                previous = GuestCopies(previous.experts[0], previous.weights)  # this device's [R, K]
            tokens = x.reshape(b * length, d)
            with jax.named_scope("route"):
                logits = tokens.astype(jnp.float32) @ router
                routed = route(logits, self.top_k, moe.score_fn, moe.normalize_topk, bias, moe.max_nodes,
                               self.topology.num_nodes)
            y, stats = moe_dispatch(tokens, routed.expert_ids, routed.gates.astype(x.dtype),
                                    ExpertWeights(w_gate, w_up, w_down), placement, self.planner,
                                    backend=moe.transport, hierarchical=moe.uses_relays(self.topology),
                                    recv_rows=self.recv_rows(tokens.shape[0]), previous=previous,
                                    weight_chunks=self.weight_chunks, gemm=moe.gemm)
            fingerprint = plan_fingerprint(stats.quotas)
            scalars = {
                "aux_loss": jax.lax.pmean(routed.aux_loss, batch_axes),
                "z_loss": jax.lax.pmean(routed.z_loss, batch_axes),
                # Whether any device's router logits or output held a NaN or Inf: the trainer names
                # the first layer where a non-finite loss began.
                "nonfinite_router": jax.lax.pmax((~jnp.isfinite(logits).all()).astype(jnp.int32), batch_axes),
                "nonfinite_output": jax.lax.pmax((~jnp.isfinite(y).all()).astype(jnp.int32), batch_axes),
                # Every rank of an expert-parallel group must hold the same plan, bit for bit: 1 when
                # their fingerprints differ (a nondeterministic planner or a corrupted all-gather).
                "plans_differ": (jax.lax.pmax(fingerprint, EP_AXES) != jax.lax.pmin(fingerprint, EP_AXES)
                                 ).astype(jnp.int32),
            }
            if len(batch_axes) > len(EP_AXES):  # expert-parallel groups side by side: any of them
                scalars["plans_differ"] = jax.lax.pmax(scalars["plans_differ"], batch_axes)
            if tracks:  # integer sums: every device gets the same totals whatever the reduction order
                ids = routed.expert_ids.astype(jnp.int32)
                local = jnp.zeros(self.planner.num_experts, jnp.int32).at[ids.reshape(-1)].add(1)
                scalars["loads"] = jax.lax.psum(local, batch_axes)
                scalars["coactivation"] = jax.lax.psum(coactivation(ids, self.planner.num_experts), batch_axes)
            per_device = {
                "imbalance_before": counts_imbalance(stats.counts, placement),
                "imbalance_after": load_imbalance(stats.quotas.quota.sum(1)),
                "inter_node_pairs": stats.planned_crossing,
                "counts": stats.counts,
                "dropped_pairs": stats.dropped,
                "scaleout_rows": stats.scaleout_rows,
            }
            guests = stats.quotas.slot_expert[:, placement.shape[1]:]
            per_device["guest_copies"] = (guests >= 0).sum(dtype=jnp.int32)
            # Copies held from the previous micro-batch, so not fetched: the weight transfers saved.
            per_device["kept_copies"] = (kept_slots(guests, previous.experts).sum(dtype=jnp.int32) if keep
                                         else jnp.zeros((), jnp.int32))
            held = GuestCopies(stats.guests.experts[None], stats.guests.weights) if keep else None
            return y.reshape(b, length, d), scalars, jax.tree.map(lambda a: a[None], per_device), held

        stats_spec = {"aux_loss": P(), "z_loss": P(), "nonfinite_router": P(), "nonfinite_output": P(),
                      "plans_differ": P()}
        if tracks:
            stats_spec.update(loads=P(), coactivation=P())
        held_spec = GuestCopies(token_spec, ExpertWeights(token_spec, token_spec, token_spec)) if keep else P()
        fn = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(token_spec, P(), expert_spec, expert_spec, expert_spec, P(), held_spec, P()),
                           out_specs=(token_spec, stats_spec, P(batch_axes), held_spec))
        w_gate, w_up, w_down = (w.get_value().astype(x.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        y, scalars, per_device, held = fn(x, self.router.get_value(), w_gate, w_up, w_down, bias, previous,
                                          self.placement.get_value())
        # Every rank of an expert-parallel group holds the same counts and plan: report the first group's.
        stats = {**scalars, **jax.tree.map(lambda a: a[0], per_device)}
        if keep:
            stats["guests"] = held
        return y, stats
