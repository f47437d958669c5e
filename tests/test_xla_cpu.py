"""jtopoep.xla_cpu: the XLA_FLAGS it writes, and that XLA:CPU then compiles a planner's loop as one kernel."""

import jax
import jax.numpy as jnp
import pytest

from jtopoep import xla_cpu
from jtopoep.planners import get_planner
from jtopoep.topology import Topology

OPTION = xla_cpu.SMALL_LOOP_OPTION


def test_adds_the_limit_to_flags_without_extra_options():
    out = xla_cpu.with_small_loop_kernels("--xla_force_host_platform_device_count=8", 4096)
    assert out == f"--xla_force_host_platform_device_count=8 --xla_backend_extra_options={OPTION}=4096"
    assert xla_cpu.with_small_loop_kernels("", 7) == f"--xla_backend_extra_options={OPTION}=7"


def test_extends_existing_extra_options_instead_of_adding_a_second_flag():
    out = xla_cpu.with_small_loop_kernels("--xla_backend_extra_options=xla_cpu_foo=1 --xla_dump_to=/tmp/d", 64)
    assert out == f"--xla_backend_extra_options=xla_cpu_foo=1,{OPTION}=64 --xla_dump_to=/tmp/d"


def test_a_limit_already_set_stands():
    flags = f"--xla_backend_extra_options={OPTION}=0"
    assert xla_cpu.with_small_loop_kernels(flags, 1 << 20) == flags


@pytest.mark.parametrize("limit", [-1, True])
def test_rejects_a_limit_that_is_not_a_byte_count(limit):
    with pytest.raises(ValueError, match="non-negative int of bytes"):
        xla_cpu.with_small_loop_kernels("", limit)


def test_configure_after_jax_started_is_an_error():
    jax.devices()  # the test session's backend is up
    with pytest.raises(RuntimeError, match="before JAX's first computation"):
        xla_cpu.configure()


def test_the_planner_loop_compiles_to_one_kernel():
    """conftest configured this process as the trainer does; XLA marks a loop it compiled into one
    kernel with the xla_cpu_small_call attribute, and topoep's copy loop must be one."""
    planner = get_planner("topoep", topology=Topology.preset("cpu-2x4"), num_experts=16, guest_slots=2)
    hlo = jax.jit(planner).lower(jnp.ones((8, 16), jnp.int32)).compile().as_text()
    assert 'xla_cpu_small_call="true"' in hlo
