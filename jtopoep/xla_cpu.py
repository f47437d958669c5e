"""XLA:CPU setting for the planners' loops: call configure() before JAX's first computation.

XLA:CPU runs every iteration of a while loop as a graph of separate kernels ("thunks") and hands the
ones that are ready together to its thread pool. The planners' loops make one copy (or one swap) per
iteration out of 15-20 small kernels, so on a small CPU the per-kernel dispatch and the handoffs
between cores cost more than the work itself. XLA's small-while-loop pass compiles a loop into one
kernel instead when the buffers it touches total at most `xla_cpu_small_while_loop_byte_threshold`
bytes, but its default limit (1 KiB) admits none of the planners' loops at R = 32, E = 256 (they
touch 64 KiB to 1 MiB); configure() raises it to SMALL_LOOP_BYTES for the process. The pass leaves
out loops that contain sorts or scatters, and the planners' loops have none.

Plans are bitwise identical with and without it (every planner, on the planner benchmark's loads);
on the planner benchmark topoep's latency drops by about a fifth (benchmarks/results/planners.md).
The setting is compile-time and CPU-only: GPU and TPU backends ignore it. The trainer, the benchmarks
and the tests call configure() before they start JAX.
"""

from __future__ import annotations

import os

SMALL_LOOP_OPTION = "xla_cpu_small_while_loop_byte_threshold"
# Large enough for the planners' loops at a few hundred experts and ranks; a loop this small runs
# faster as one kernel on one thread than as a graph of kernels on a pool.
SMALL_LOOP_BYTES = 16 << 20
_EXTRA_OPTIONS = "--xla_backend_extra_options="


def with_small_loop_kernels(xla_flags: str, limit: int = SMALL_LOOP_BYTES) -> str:
    """`xla_flags` (an XLA_FLAGS string) with the small-loop limit added to its backend extra options.

    A limit the flags already set is left as it is: the caller's choice stands."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"small-loop limit must be a non-negative int of bytes, got {limit!r}")
    if SMALL_LOOP_OPTION in xla_flags:
        return xla_flags
    flags = xla_flags.split()
    setting = f"{SMALL_LOOP_OPTION}={limit}"
    for i, flag in enumerate(flags):
        if flag.startswith(_EXTRA_OPTIONS):  # the options are one comma-separated flag; extend it
            existing = flag[len(_EXTRA_OPTIONS):]
            flags[i] = _EXTRA_OPTIONS + (f"{existing},{setting}" if existing else setting)
            break
    else:
        flags.append(_EXTRA_OPTIONS + setting)
    return " ".join(flags)


def configure(limit: int = SMALL_LOOP_BYTES) -> None:
    """Set the small-loop limit in this process's XLA_FLAGS. XLA reads the flags once, when JAX
    starts its first backend, so this must run before any JAX computation."""
    from jax._src import xla_bridge  # backends_are_initialized has no public name

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("jtopoep.xla_cpu.configure() must run before JAX's first computation: XLA has "
                           "already read XLA_FLAGS in this process. Call it at the top of the program.")
    os.environ["XLA_FLAGS"] = with_small_loop_kernels(os.environ.get("XLA_FLAGS", ""), limit)
