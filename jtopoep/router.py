"""Top-k router: scores, expert choice, gate weights, and the usual balancing losses.

- scores: softmax over experts (Switch, Mixtral) or per-expert sigmoid (DeepSeek-V3);
- choice: top-k of scores + bias, where the bias (auxiliary-loss-free balancing, DeepSeek-V3) steers
  only which experts are chosen, never the gate values; with max_nodes = M, among the experts of the
  M nodes whose ceil(k / M) best experts score highest in sum (DeepSeek-V3's node-limited routing,
  experts homed contiguously, E / N a node), so a token crosses to at most M nodes;
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


def node_limited(choice: Float[Array, "T E"], top_k: int, max_nodes: int, num_nodes: int) -> Float[Array, "T E"]:
    """choice with the experts outside each token's max_nodes best nodes set to -inf."""
    tokens, num_experts = choice.shape
    per_node = num_experts // num_nodes
    best = jax.lax.top_k(choice.reshape(tokens, num_nodes, per_node), min(-(-top_k // max_nodes), per_node))[0]
    _, nodes = jax.lax.top_k(best.sum(-1), max_nodes)  # [T, M]
    allowed = jnp.zeros((tokens, num_nodes), bool).at[jnp.arange(tokens)[:, None], nodes].set(True)
    return jnp.where(jnp.repeat(allowed, per_node, axis=1), choice, -jnp.inf)


def route(logits: Float[Array, "T E"], top_k: int, score_fn: str = "softmax", normalize: bool = True,
          bias: Float[Array, " E"] | None = None, max_nodes: int = 0, num_nodes: int = 1) -> RouterOutput:
    """max_nodes: 0 (or num_nodes and above) routes to any expert; else at most this many of the
    num_nodes nodes per token (E a multiple of num_nodes, max_nodes * E / num_nodes >= top_k)."""
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    if score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score_fn == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown score_fn {score_fn!r}; known: ['softmax', 'sigmoid']")
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    if 0 < max_nodes < num_nodes:
        if num_experts % num_nodes or max_nodes * (num_experts // num_nodes) < top_k:
            raise ValueError(f"max_nodes = {max_nodes} needs E = {num_experts} to be a multiple of the {num_nodes} "
                             f"nodes and max_nodes * E / nodes >= top_k = {top_k}")
        choice = node_limited(choice, top_k, max_nodes, num_nodes)
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
