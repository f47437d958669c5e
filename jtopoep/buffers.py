"""Zero-filled buffers that XLA allocates where they are used, not at the start of the program.

XLA merges equal broadcasts of one constant, and the copies its in-place users need (loop carries,
collective outputs) end up in one multi-output fusion placed early in the schedule, so every such
buffer of the program is live from there on, together, however late it is used. A zero that passes
an optimization barrier with the buffer's input is known only once that input is, and differs from
every other call's, so its broadcast is neither merged nor hoisted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_after(after: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """zeros(shape, dtype), materialised no earlier than `after` is."""
    zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), after))
    return jnp.broadcast_to(zero, shape)
