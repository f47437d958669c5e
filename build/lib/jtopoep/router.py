"""Top-k router: scores, expert choice, gate weights, and the usual balancing losses.

- scores: softmax over experts (Switch, Mixtral) or per-expert sigmoid (DeepSeek-V3);
- choice: top-k of scores + bias, where the bias (auxiliary-loss-free balancing, DeepSeek-V3) steers
  only which experts are chosen, never the gate values;
- gates: the chosen scores, renormalised to sum to 1 when asked;
- aux loss (Switch Transformer): E * sum_e f_e * P_e, f_e the share of routed pairs, P_e the mean score;
- z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class RouterOutput(NamedTuple):
    expert_ids: Int[Array, "T k"]
    gates: Float[Array, "T k"]
    aux_loss: Float[Array, ""]
    z_loss: Float[Array, ""]


def route(logits: Float[Array, "T E"], top_k: int, score_fn: str = "softmax", normalize: bool = True,
          bias: Float[Array, " E"] | None = None) -> RouterOutput:
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    if score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score_fn == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown score_fn {score_fn!r}; known: ['softmax', 'sigmoid']")
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    _, expert_ids = jax.lax.top_k(choice, top_k)
    gates = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if normalize:
        gates = gates / jnp.maximum(gates.sum(-1, keepdims=True), 1e-9)
    picked = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32).sum(1)  # [T, E]
    share = picked.mean(0) / top_k
    probs = scores / jnp.maximum(scores.sum(-1, keepdims=True), 1e-9)
    aux = num_experts * jnp.sum(jax.lax.stop_gradient(share) * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return RouterOutput(expert_ids.astype(jnp.int32), gates, aux, z)


def bias_update(bias: Float[Array, " E"], counts: Int[Array, "R E"], rate: float) -> Float[Array, " E"]:
    """Auxiliary-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded."""
    load = counts.sum(0).astype(jnp.float32)
    return bias + rate * jnp.sign(load.mean() - load)
