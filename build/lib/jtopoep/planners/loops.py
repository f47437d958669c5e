"""Planner loops that stop once their work is done, without a host round trip per step on accelerators.

A copy loop makes one copy per step and ends early, once nothing is left to copy. As a data-dependent
`while_loop` that costs nothing on CPU, but XLA:GPU runs such a loop by copying the exit test to the
host and blocking on the stream after every iteration (its WhileThunk without a known trip count):
dozens of host syncs per MoE layer, inside the training step that is meant to have none. A loop with
a static trip count runs on the device alone. Every loop here is written so that a step run after
the work is done changes nothing, so the two forms give the same plan bit for bit, and
`jax.lax.platform_dependent` picks one when the step is lowered for its platform.
"""

from __future__ import annotations

import jax
import numpy as np

# Platforms where the loop exits early. Elsewhere it runs its full static trip count.
EARLY_EXIT_PLATFORMS: tuple[str, ...] = ("cpu",)


def step_until_done(step, carry, count, bound: int):
    """Apply `step` to `carry` while count(carry) < bound, at most `bound` times.

    step must leave count(carry) at `bound` or above once it finds nothing to do, and change nothing
    when applied to such a carry (its own no-op); then stopping there and running all `bound` steps
    are the same. On EARLY_EXIT_PLATFORMS a while loop stops at the first finished carry; elsewhere a
    loop of exactly `bound` steps runs, which XLA knows the trip count of."""
    def early(c):
        return jax.lax.while_loop(lambda c: count(c) < bound, step, c)

    def fixed(c):
        return jax.lax.fori_loop(0, bound, lambda _, c: step(c), c)

    platforms = {name: early for name in EARLY_EXIT_PLATFORMS}
    return jax.lax.platform_dependent(carry, default=fixed, **platforms)


def repeat(body, times: int, carry, xp):
    """body(i, carry) applied `times` times: a Python loop on NumPy arrays (xp is np), else a
    fori_loop with a static trip count, which runs on the device alone and which XLA:CPU compiles
    into one kernel (jtopoep.xla_cpu's small-loop limit) where as separate kernels per step their
    dispatch would cost more than their work. A trip count of one XLA inlines all the same."""
    if xp is np:
        for i in range(times):
            carry = body(i, carry)
        return carry
    return jax.lax.fori_loop(0, times, body, carry)
