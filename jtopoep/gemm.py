"""The grouped GEMM of the expert slots: rows in slot order, group g multiplied by weights[g].

Implementations (moe.gemm):
- "xla": `jax.lax.ragged_dot`. How it runs is XLA's choice per backend: XLA:CPU expands it into a
  dense dot over every group, masked, so its cost follows the buffer, not the rows that arrived;
  recent XLA:GPU releases hand it to a grouped-GEMM library where they can
  (`benchmarks/gpu_check.sh` times whether the one installed does: rows in use against rows held).
- "pallas": the megablox grouped matmul (Pallas, TPU): tiles over the rows in use, with its own
  backward (`jax.experimental.pallas.ops.tpu.megablox`); on other backends it runs in Pallas's
  interpret mode, which is for tests, not speed.
- "auto": "pallas" on TPU, "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

GEMMS = ("auto", "xla", "pallas")
_TILE = 128


def resolve_gemm(gemm: str) -> str:
    if gemm not in GEMMS:
        raise ValueError(f"unknown grouped GEMM {gemm!r}; known: {list(GEMMS)}")
    if gemm == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "xla"
    return gemm


def grouped_matmul(x: Float[Array, "M K"], weights: Float[Array, "G K N"], group_sizes: Int[Array, " G"],
                   gemm: str = "xla") -> Float[Array, "M N"]:
    """x[rows of group g] @ weights[g] for each group in order; rows past the groups give zeros."""
    gemm = resolve_gemm(gemm)
    if gemm == "xla":
        return jax.lax.ragged_dot(x, weights, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    rows, depth = x.shape
    width = weights.shape[-1]
    tiling = (min(_TILE, rows), min(_TILE, depth), min(_TILE, width))
    padded = -(-rows // tiling[0]) * tiling[0]  # megablox tiles the rows whole
    # It leaves rows past the groups unwritten, forward and backward: selects (not products) keep
    # whatever is there out of the result and out of x's gradient.
    used = (jnp.arange(padded) < group_sizes.sum())[:, None]
    x = jnp.where(used, jnp.pad(x, ((0, padded - rows), (0, 0))), 0)
    out = megablox.gmm(x, weights, group_sizes.astype(jnp.int32), x.dtype, tiling, None, None, False,
                       jax.default_backend() != "tpu")
    return jnp.where(used, out, 0)[:rows]
