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
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jtopoep.config import ModelConfig, MoEConfig
from jtopoep.guests import GuestCopies
from jtopoep.layer import MoELayer
from jtopoep.topology import Topology


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


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, moe: MoEConfig | None, topology: Topology, mesh: Mesh, *,
                 rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
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
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        if self.moe is None:
            return x + self.ffn(h), None
        y, stats = self.moe(h, previous)
        if self.shared is not None:
            y = y + self.shared(h)
        return x + y, stats


class MoETransformer(nnx.Module):
    def __init__(self, config: ModelConfig, moe: MoEConfig, topology: Topology, mesh: Mesh, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([
            Block(config, moe if config.is_moe_layer(i) else None, topology, mesh, rngs=rngs)
            for i in range(config.num_layers)])
        self.norm = nnx.RMSNorm(config.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: Int[Array, "B L"],
                 previous: list[GuestCopies] | None = None) -> tuple[Float[Array, "B L V"], list[dict]]:
        """Logits and each MoE layer's stats. previous: one GuestCopies per MoE layer, the copies it
        held after the previous micro-batch of this optimizer step (MoELayer.__call__); each layer's
        stats then hold its copies after this call under "guests"."""
        x = self.embed(tokens)
        stats = []
        held = iter(previous) if previous is not None else None
        for block in self.blocks:
            x, layer_stats = block(x, None if held is None or block.moe is None else next(held))
            if layer_stats is not None:
                stats.append(layer_stats)
        return self.head(self.norm(x)), stats

    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.blocks if block.moe is not None]
