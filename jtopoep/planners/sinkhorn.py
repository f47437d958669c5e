"""Log-domain Sinkhorn for balanced entropic optimal transport, with a fixed iteration count.

  minimise <P, M> - epsilon H(P)  subject to  P 1 = a,  P^T 1 = b,  P >= 0     (sum a = sum b)

Scaling potentials f, g are updated in the log domain, so small epsilon neither underflows nor
overflows; where the cost is known when tracing and exp(-cost / epsilon) is bounded well away from
0 (TAOT's link costs at its epsilon), the same iterations run on the scalings exp(f / epsilon),
exp(g / epsilon): two matrix-vector products an iteration instead of two log-sum-exps. Zero-mass
rows and columns are masked out of every log-sum-exp, or get zero scalings (their potentials stay 0
and their rows/columns of P are exactly 0), so degenerate inputs never produce NaN or Inf. The trip
count is static: every device runs the same float operations in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp
import numpy as np
from jaxtyping import Array, Float

ArrayLike = Array | np.ndarray  # host inputs are accepted and moved to the device


class SinkhornOutput(NamedTuple):
    plan: Float[Array, "n m"]  # transport plan with the masses of a and b
    marginal_error: Float[Array, ""]  # (|P 1 - a|_1 + |P^T 1 - b|_1) / sum(a), 0 for zero mass


@dataclasses.dataclass(frozen=True)
class Sinkhorn:
    epsilon: float = 0.05  # entropic regularisation, in units of the cost
    iterations: int = 50  # static trip count

    def __post_init__(self):
        if not self.epsilon > 0:
            raise ValueError(f"epsilon = {self.epsilon} must be > 0")
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations = {self.iterations!r} must be a positive int")

    def __call__(self, a: Float[ArrayLike, " n"], b: Float[ArrayLike, " m"],
                 cost: Float[ArrayLike, "n m"]) -> SinkhornOutput:
        return sinkhorn(a, b, cost, self.epsilon, self.iterations)


def _safe_lse(x, axis):
    out = logsumexp(x, axis=axis)
    return jnp.where(jnp.isfinite(out), out, 0.0)


# The least entry of exp(-cost / epsilon) for which the iterations run on the scalings u = exp(f /
# epsilon), v = exp(g / epsilon) instead of their logs: two matrix-vector products an iteration and no
# exp or log (the same iterates in exact arithmetic). Kernel entries this far above float32's
# smallest normal keep u, v and the plan finite and normal.
SCALED_KERNEL_MIN = 1e-6
# Iterations unrolled into one step of the scaled loop off CPU (_scaled_sinkhorn).
UNROLL = 16


def sinkhorn(a: Float[ArrayLike, " n"], b: Float[ArrayLike, " m"], cost: Float[ArrayLike, "n m"],
             epsilon: float, iterations: int) -> SinkhornOutput:
    if isinstance(cost, np.ndarray) and np.exp(-float(np.max(cost, initial=0.0)) / epsilon) >= SCALED_KERNEL_MIN:
        return _scaled_sinkhorn(a, b, np.exp(-cost.astype(np.float32) / np.float32(epsilon)), iterations)
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    cost = jnp.asarray(cost, jnp.float32)
    total = a.sum()
    a_mass = a > 0
    b_mass = b > 0
    # Normalise both sides to probability vectors: the plan is then scaled back by the supply total.
    log_a = jnp.where(a_mass, jnp.log(jnp.where(a_mass, a / jnp.maximum(total, 1e-30), 1.0)), 0.0)
    log_b = jnp.where(b_mass, jnp.log(jnp.where(b_mass, b / jnp.maximum(b.sum(), 1e-30), 1.0)), 0.0)
    kernel = -cost / epsilon

    def update(_, fg):
        f, g = fg
        rows = jnp.where(b_mass[None, :], kernel + g[None, :] / epsilon, -jnp.inf)
        f = jnp.where(a_mass, epsilon * (log_a - _safe_lse(rows, 1)), 0.0)
        cols = jnp.where(a_mass[:, None], kernel + f[:, None] / epsilon, -jnp.inf)
        g = jnp.where(b_mass, epsilon * (log_b - _safe_lse(cols, 0)), 0.0)
        return f, g

    f, g = jax.lax.fori_loop(0, iterations, update, (jnp.zeros_like(a), jnp.zeros_like(b)))
    mask = a_mass[:, None] & b_mass[None, :]
    log_plan = jnp.where(mask, kernel + (f[:, None] + g[None, :]) / epsilon, -jnp.inf)
    return _output(jnp.exp(log_plan) * total, a, b)


def _output(plan, a, b) -> SinkhornOutput:
    """The plan with its marginal error relative to the supply (0 for zero mass)."""
    total = a.sum()
    error = jnp.abs(plan.sum(1) - a).sum() + jnp.abs(plan.sum(0) - b).sum()
    return SinkhornOutput(plan, jnp.where(total > 0, error / jnp.maximum(total, 1e-30), 0.0))


def _scaled_sinkhorn(a, b, kernel: np.ndarray, iterations: int) -> SinkhornOutput:
    """sinkhorn() on the scalings, for a kernel exp(-cost / epsilon) known when tracing and bounded
    below (SCALED_KERNEL_MIN). Zero-mass rows and columns get zero scalings, so their rows and
    columns of the plan are exactly 0."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    kernel = jnp.asarray(kernel, jnp.float32)
    total = a.sum()
    a_mass, b_mass = a > 0, b > 0
    a_share = jnp.where(a_mass, a / jnp.maximum(total, 1e-30), 0.0)
    b_share = jnp.where(b_mass, b / jnp.maximum(b.sum(), 1e-30), 0.0)

    def scale(share, mass, reach):  # share / reach where there is mass and reach, else 0
        return jnp.where(mass & (reach > 0), share / jnp.where(reach > 0, reach, 1.0), 0.0)

    # Products as multiply-and-sum reductions, not dots: a GPU would run a float32 dot in TF32 or
    # through a library call; a reduction is float32 and fused.
    def update(_, uv):
        _, v = uv
        u = scale(a_share, a_mass, (kernel * v[None, :]).sum(1))
        return u, scale(b_share, b_mass, (kernel * u[:, None]).sum(0))

    start = (jnp.zeros_like(a), b_mass.astype(jnp.float32))
    # XLA:CPU compiles the loop into one kernel. Elsewhere it runs unrolled (up to UNROLL iterations
    # a loop step): over the few nodes XLA:GPU then fuses several iterations' reductions into one
    # kernel, where a loop body ends at least two kernels an iteration.
    u, v = jax.lax.platform_dependent(
        start, cpu=lambda uv: jax.lax.fori_loop(0, iterations, update, uv),
        default=lambda uv: jax.lax.fori_loop(0, iterations, update, uv, unroll=min(iterations, UNROLL)))
    return _output(u[:, None] * kernel * v[None, :] * total, a, b)
