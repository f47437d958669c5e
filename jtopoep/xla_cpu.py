"""XLA:CPU settings for programs of many small kernels, such as the planners: call configure() before
JAX's first computation.

XLA:CPU runs a program as a graph of separate kernels ("thunks") and hands the ones that are ready
together to its thread pool. A planner is some hundred small kernels plus a loop (one copy or one
swap per iteration, 15-20 kernels each), and on a small CPU the dispatch and the handoffs between
cores cost more than the work. configure() sets three compile-time options for the process:

- `xla_cpu_small_while_loop_byte_threshold` (a backend extra option): XLA compiles a while loop into
  one kernel when the buffers it touches total at most this many bytes. The default, 1 KiB, admits
  none of the planners' loops at R = 32, E = 256 (they touch 64 KiB to 1 MiB); configure() raises it
  to SMALL_LOOP_BYTES. The pass leaves out loops that contain a sort (or top_k; scatters and gathers
  it keeps), so the planners' rounds across nodes, which sort, stay a graph of kernels, and their
  sort-free loops (Sinkhorn's) become one kernel each.
- `--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED`: the default scheduler orders a
  program for concurrency; the memory-optimised one reuses buffers, and each reuse is a dependency,
  so fewer kernels are ready at once. topoep's program then starts from 4 ready kernels instead of
  20, and far fewer handoffs cross cores.
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's loop emitters instead of its MLIR fusion
  emitters. The MLIR emitters spend most of a planner's compile on its hundreds of small fusions;
  the loop emitters compile the planners in less time, and their calls run as fast.

Plans are bitwise identical with and without them (eplb, topoep and taot at E = 64 and 256, K = 1
and 2, on micro-batches of every load family of the planner benchmark; the loop emitters also at
R = 256), and the benchmark times the first two (benchmarks/results/planners.md). All are CPU-only:
the GPU backend ignores the scheduler type and the xla_cpu_ flags, and passes to LLVM only the extra
options not named xla_*. A setting the caller's XLA_FLAGS already make stands. The trainer and the
benchmarks call configure() before they start JAX; the tests leave out the scheduler
(tests/conftest.py says why).

emulate_cpu_devices() gives the CPU backend as many devices as a mesh needs, so that the trainer and
the dispatch benchmark run their meshes on a machine without accelerators.
"""

from __future__ import annotations

import os

SMALL_LOOP_OPTION = "xla_cpu_small_while_loop_byte_threshold"
# Large enough for the planners' loops at a few hundred experts and ranks; a loop this small runs
# faster as one kernel on one thread than as a graph of kernels on a pool.
SMALL_LOOP_BYTES = 16 << 20
SCHEDULER_FLAG = "--xla_cpu_scheduler_type"
MEMORY_OPTIMIZED = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
_EXTRA_OPTIONS = "--xla_backend_extra_options="
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"


def cpu_flags(xla_flags: str, small_loop_bytes: int = SMALL_LOOP_BYTES, memory_scheduler: bool = True,
              loop_emitters: bool = True) -> str:
    """`xla_flags` (an XLA_FLAGS string) with the small-loop limit added to its backend extra options,
    with memory_scheduler the memory-optimised scheduler, and with loop_emitters XLA:CPU's loop
    emitters. Settings already there stand."""
    if isinstance(small_loop_bytes, bool) or not isinstance(small_loop_bytes, int) or small_loop_bytes < 0:
        raise ValueError(f"small_loop_bytes must be a non-negative int, got {small_loop_bytes!r}")
    flags = xla_flags.split()
    if SMALL_LOOP_OPTION not in xla_flags:
        setting = f"{SMALL_LOOP_OPTION}={small_loop_bytes}"
        for i, flag in enumerate(flags):
            if flag.startswith(_EXTRA_OPTIONS):  # the options are one comma-separated flag; extend it
                existing = flag[len(_EXTRA_OPTIONS):]
                flags[i] = _EXTRA_OPTIONS + (f"{existing},{setting}" if existing else setting)
                break
        else:
            flags.append(_EXTRA_OPTIONS + setting)
    if memory_scheduler and not any(flag.startswith(SCHEDULER_FLAG + "=") for flag in flags):
        flags.append(f"{SCHEDULER_FLAG}={MEMORY_OPTIMIZED}")
    if loop_emitters and not any(flag.startswith(FUSION_EMITTERS_FLAG + "=") for flag in flags):
        flags.append(f"{FUSION_EMITTERS_FLAG}=false")
    return " ".join(flags)


def _require_no_backend(caller: str) -> None:
    from jax._src import xla_bridge  # backends_are_initialized has no public name

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(f"jtopoep.xla_cpu.{caller}() must run before JAX's first computation: XLA has "
                           "already read XLA_FLAGS in this process. Call it at the top of the program.")


def configure(small_loop_bytes: int = SMALL_LOOP_BYTES, memory_scheduler: bool = True,
              loop_emitters: bool = True) -> None:
    """Apply cpu_flags() to this process's XLA_FLAGS. XLA reads the flags once, when JAX starts its
    first backend, so this must run before any JAX computation."""
    _require_no_backend("configure")
    os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), small_loop_bytes, memory_scheduler,
                                        loop_emitters)


def emulate_cpu_devices(count: int) -> None:
    """Have the CPU backend present `count` devices, to run a mesh without accelerators, unless this
    process's XLA_FLAGS already force a device count (the caller's choice stands). No effect on GPU or
    TPU backends; like configure(), it must run before JAX's first computation."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    _require_no_backend("emulate_cpu_devices")
    if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        import jax

        jax.config.update("jax_num_cpu_devices", count)
