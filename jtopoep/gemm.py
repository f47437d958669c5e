"""The grouped GEMM of the expert slots: rows in slot order, group g multiplied by weights[g].

Implementations (moe.gemm):
- "xla": `jax.lax.ragged_dot`. How it runs is XLA's choice per backend: XLA:CPU, and XLA:GPU as of
  JAX 0.11, expand it into a dense dot per group over the whole buffer, masked, so its cost is
  groups x buffer rows (`benchmarks/gpu_check.sh` records whether the installed XLA:GPU does).
- "pallas": a Pallas grouped-GEMM kernel with its own backward. On TPU the megablox grouped matmul
  (`jax.experimental.pallas.ops.tpu.megablox`), tiling the rows in use; on Hopper GPUs the Mosaic
  GPU ragged dot (`jtopoep.gemm_hopper`), one pass over the buffer instead of one per group (every
  call sweeps the whole buffer, so the layer makes one call per hidden slice over home and guest
  slots together: dispatch.expert_ffn); on other GPUs it is refused; on CPU megablox runs in
  Pallas's interpret mode, for tests, not speed.
- "tiled": a loop over tiles of rows in plain XLA operations (`jtopoep.gemm_tiled`), any backend and
  dtype: its cost follows the rows in use, plus at most one tile per group, and its temporaries are
  a tile's. It takes the first row of its groups, so the guest slots need not be moved to row 0.
- "auto": "pallas" on TPU; "tiled" on GPUs (any shape or dtype, where the Hopper kernels need
  bfloat16 and multiples of 128; XLA:GPU's expansion of ragged_dot costs groups x rows); "xla" on
  CPU, where jtopoep.xla_cpu.configure() compiles a loop touching under 16 MiB into one kernel of
  naive products, which makes small layers' tiled weight gradient (the tiny model's) several times
  slower than ragged_dot (benchmarks/results/gemm_cpu.md; larger layers run faster tiled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

GEMMS = ("auto", "xla", "pallas", "tiled")
_TILE = 128


def resolve_gemm(gemm: str) -> str:
    if gemm not in GEMMS:
        raise ValueError(f"unknown grouped GEMM {gemm!r}; known: {list(GEMMS)}")
    if gemm == "auto":
        return {"tpu": "pallas", "gpu": "tiled"}.get(jax.default_backend(), "xla")
    return gemm


# Guest-weight slices where moe.guest_weight_chunks is 0 (auto), by grouped GEMM. The tiled loops write
# every slice into one output buffer, so slices only shrink the fetch's send buffers (one slice of
# several whole experts each); xla and pallas give each slice a buffer-sized output of its own.
AUTO_WEIGHT_CHUNKS = {"tiled": 4, "xla": 2, "pallas": 2}


def most_slices(upto: int, gemm: str, expert_hidden: int) -> int:
    """The most slices of the hidden width, at most `upto`, that divide expert_hidden and, for pallas,
    fill the Hopper kernels' tiles (jtopoep.gemm_hopper.TILE); 0 where none does."""
    from jtopoep.gemm_hopper import TILE

    pallas = resolve_gemm(gemm) == "pallas"
    return next((c for c in range(upto, 0, -1)
                 if expert_hidden % c == 0 and (not pallas or (expert_hidden // c) % TILE == 0)), 0)


def resolve_weight_chunks(chunks: int, gemm: str, expert_hidden: int) -> int:
    """moe.guest_weight_chunks as the layer runs it: `chunks` where set (> 0); for 0 (auto),
    most_slices up to AUTO_WEIGHT_CHUNKS[gemm], 1 where none fits."""
    if chunks:
        return chunks
    return most_slices(AUTO_WEIGHT_CHUNKS[resolve_gemm(gemm)], gemm, expert_hidden) or 1


def sweeps_whole_buffer(gemm: str) -> bool:
    """Whether one call costs the whole buffer's rows whatever its groups hold: the Hopper kernels
    tile every row (jtopoep.gemm_hopper); ragged_dot's dense expansion costs its groups x rows, and
    megablox tiles the rows in use."""
    return resolve_gemm(gemm) == "pallas" and jax.default_backend() == "gpu"


def takes_first_row(gemm: str) -> bool:
    """Whether grouped_matmul can start the groups past row 0 (otherwise the rows must be moved)."""
    return resolve_gemm(gemm) == "tiled"


def grouped_matmul(x: Float[Array, "M K"], weights: Float[Array, "G K N"], group_sizes: Int[Array, " G"],
                   gemm: str = "xla", first_row: Int[Array, ""] | int = 0) -> Float[Array, "M N"]:
    """x[rows of group g] @ weights[g] for each group in order, the groups' rows starting at
    first_row (only where takes_first_row(gemm)); the other rows give zeros."""
    if resolve_gemm(gemm) == "tiled":
        from jtopoep.gemm_tiled import tiled_grouped_matmul

        return tiled_grouped_matmul(x, weights, group_sizes, first_row)
    if not isinstance(first_row, int) or first_row:
        raise ValueError(f"moe.gemm={gemm} starts the groups at row 0; only moe.gemm=tiled takes first_row")
    if resolve_gemm(gemm) == "xla":
        return jax.lax.ragged_dot(x, weights, group_sizes)
    if sweeps_whole_buffer(gemm):  # pallas on a GPU: the Hopper kernels
        from jtopoep.gemm_hopper import hopper_available, hopper_grouped_matmul

        if not hopper_available():
            raise ValueError(f"moe.gemm=pallas on GPU needs a Hopper GPU (compute capability 9.0) and JAX's Mosaic GPU "
                             f"ragged-dot kernels; found {jax.devices()[0].device_kind}: use moe.gemm=xla")
        return hopper_grouped_matmul(x, weights, group_sizes)
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
