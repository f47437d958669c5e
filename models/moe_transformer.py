"""Decoder-only MoE language model built on jtopoep.layer.MoELayer.

Pre-norm blocks: RMSNorm -> causal rotary attention -> residual, RMSNorm -> FFN -> residual, where the
FFN is an MoELayer on MoE layers (ModelConfig.is_moe_layer) plus optional always-on shared experts,
and a dense SwiGLU elsewhere.

Precision: parameters are float32; activations, matmuls and the MoE exchange run in
ModelConfig.dtype. Norm statistics, attention softmax, router and loss are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jtopoep.config import ModelConfig, MoEConfig
from jtopoep.guests import GuestCopies
from jtopoep.layer import MoELayer
from jtopoep.topology import EP_AXES, Topology

# The expert weights' layout: stacked over the MoE layers, each layer's experts split over the
# expert-parallel axes [layers, E, ...].
EXPERT_SPEC = P(None, EP_AXES)


def rotary(x: Float[Array, "B L N H"], theta: float) -> Float[Array, "B L N H"]:
    length, half = x.shape[1], x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * freq[None, :]  # [L, H/2]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, n = config.d_model, config.num_heads
        self.num_heads, self.theta = n, config.rope_theta
        dtype = jnp.dtype(config.dtype)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "B L D"]) -> Float[Array, "B L D"]:
        b, length, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, length, 3, self.num_heads, d // self.num_heads), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        scores = jnp.einsum("blnh,bmnh->bnlm", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -1e30), axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bnlm,bmnh->blnh", weights, v).reshape(b, length, d))


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate = nnx.Linear(d_model, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def _attend(norm: nnx.RMSNorm, attn: Attention, x):
    return attn(norm(x))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, moe: MoEConfig | None, topology: Topology, mesh: Mesh, *,
                 rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.remat_attention = config.remat == "attention"
        self.attn_norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
        if moe is None:
            self.ffn = SwiGLU(config.d_model, config.dense_hidden, dtype=dtype, rngs=rngs)
            self.moe, self.shared = None, None
        else:
            self.ffn = None
            self.moe = MoELayer(config.d_model, config.num_experts, config.top_k, config.expert_hidden, moe,
                                topology, mesh, dtype=dtype, rngs=rngs)
            shared_hidden = config.shared_experts * config.expert_hidden
            self.shared = SwiGLU(config.d_model, shared_hidden, dtype=dtype, rngs=rngs) if config.shared_experts else None

    def __call__(self, x, previous: GuestCopies | None = None):
        if self.remat_attention:  # the backward pass recomputes the attention from the block's input
            x = x + nnx.remat(_attend)(self.attn_norm, self.attn, x)
        else:
            x = x + _attend(self.attn_norm, self.attn, x)
        h = self.ffn_norm(x)
        if self.moe is None:
            return x + self.ffn(h), None
        y, stats = self.moe(h, previous)
        if self.shared is not None:
            y = y + self.shared(h)
        return x + y, stats


class Unit(nnx.Module):
    """One MoE block and the moe_every - 1 dense blocks after it: what the model repeats."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, topology: Topology, mesh: Mesh, *, rngs: nnx.Rngs):
        self.moe_block = Block(config, moe, topology, mesh, rngs=rngs)
        self.dense = nnx.List([Block(config, None, topology, mesh, rngs=rngs) for _ in range(config.moe_every - 1)])

    def __call__(self, x, previous: GuestCopies | None = None):
        x, stats = self.moe_block(x, previous)
        for block in self.dense:
            x, _ = block(x)
        return x, stats


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """The first module, its every variable holding all the modules' values stacked on a new leading
    axis (the modules must have the same structure)."""
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *(nnx.state(m) for m in modules))
    nnx.update(modules[0], stacked)
    return modules[0]


class MoETransformer(nnx.Module):
    """Embedding, first_dense_layers dense blocks, then the MoE layers, each in a Unit with the dense
    blocks that follow it. The units' variables are stacked on a leading layer axis and the forward
    pass runs them with jax.lax.scan (ModelConfig.scan_layers), so the step compiles one unit, the
    planner in it once, whatever the depth; without the scan, a Python loop over the same stack."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, topology: Topology, mesh: Mesh, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.scan_layers = config.scan_layers
        self.remat_layers = config.remat == "full"
        self.num_moe_layers = config.num_moe_layers
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.prefix = nnx.List([Block(config, None, topology, mesh, rngs=rngs)
                                for _ in range(config.first_dense_layers)])
        units = [Unit(config, moe, topology, mesh, rngs=rngs) for _ in range(self.num_moe_layers)]
        self.units = stack_modules(units)
        self.norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: Int[Array, "B L"],
                 previous: GuestCopies | None = None) -> tuple[Float[Array, "B L V"], dict]:
        """Logits and the MoE layers' stats, each stacked over the layers [layers, ...]. previous: the
        guest copies every MoE layer held after the previous micro-batch of this optimizer step,
        stacked over the layers (no_guest_copies() before the first); the stats then hold the
        copies after this call under "guests" (MoELayer.__call__)."""
        x = self.embed(tokens)
        for block in self.prefix:
            x, _ = block(x)
        graphdef, state = nnx.split(self.units)

        def unit(x, layer):
            state, held = layer
            return nnx.merge(graphdef, state)(x, held)

        if self.remat_layers:  # keep each unit's input; the backward pass recomputes the rest
            unit = jax.checkpoint(unit, prevent_cse=not self.scan_layers)

        if self.scan_layers:
            x, stats = jax.lax.scan(unit, x, (state, previous))
        else:
            outs = []
            for i in range(self.num_moe_layers):
                x, out = unit(x, jax.tree.map(lambda a: a[i], (state, previous)))
                outs.append(out)
            stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return self.head(self.norm(x)), stats

    def moe_layer(self, index: int | None = None) -> MoELayer:
        """The MoE layers as one MoELayer whose variables are stacked over the layers (index None),
        or layer `index`'s own, unstacked copy (a new module: setting its variables changes nothing
        here)."""
        if index is None:
            return self.units.moe_block.moe
        graphdef, state = nnx.split(self.units.moe_block.moe)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))

    def no_guest_copies(self) -> GuestCopies:
        """Every MoE layer's held copies before a step's first micro-batch, stacked over the layers."""
        empty = self.moe_layer(0).no_guest_copies()
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.num_moe_layers,) + a.shape), empty)
