"""Compiling for H100 GPUs on a machine without one (benchmarks.memory and benchmarks.kernels,
--target h100).

With JAX's CUDA plugin installed (`pip install "jax-cuda12-plugin[with-cuda]==<jax version>"`; no GPU
needed), `jax.experimental.topologies` describes H100s from gpu_specs/h100_sxm.txtpb (an H800 is the
same die) and XLA:GPU compiles for them: the buffers and kernels a GPU run gets.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib

GPU_SPEC = pathlib.Path(__file__).resolve().parent / "gpu_specs" / "h100_sxm.txtpb"
NEEDS_PLUGIN = '--target h100 needs JAX\'s CUDA plugin: pip install "jax-cuda12-plugin[with-cuda]==<jax version>"'


def cuda_plugin_installed() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def described_gpus(num_nodes: int, gpus_per_node: int) -> list:
    """The described H100s of a (num_nodes x gpus_per_node) cluster, for compiling without them.
    Call before JAX starts a backend."""
    import jax
    from jax.experimental import topologies

    # Compile only: the plugin must load without a GPU here, and JAX must not start a CUDA client.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    jax.config.update("jax_platforms", "cpu")
    return list(topologies.get_topology_desc(platform="cuda", topology_name="", target_config=GPU_SPEC.read_text(),
                                             topology=f"1x{num_nodes}x{gpus_per_node}").devices)


@contextlib.contextmanager
def answering_as(devices):
    """JAX's device queries answer with the described GPUs while a program is built and compiled, so
    everything that asks which platform it runs on (the transport's and GEMM's `auto`, the Hopper
    check, the Mosaic GPU kernel's SM count) chooses as on those GPUs."""
    import jax

    from jtopoep import gemm_hopper

    saved = jax.default_backend, jax.devices
    jax.default_backend, jax.devices = (lambda *_: "gpu"), (lambda *_, **__: list(devices))
    gemm_hopper.hopper_available.cache_clear()
    try:
        yield
    finally:
        jax.default_backend, jax.devices = saved
        gemm_hopper.hopper_available.cache_clear()
