"""jtopoep.xla_cpu: the XLA_FLAGS it writes, and that XLA:CPU then compiles a planner's loop as one kernel."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jtopoep import xla_cpu
from jtopoep.planners import get_planner
from jtopoep.topology import Topology

from conftest import FUSION_EMITTERS

OPTION = xla_cpu.SMALL_LOOP_OPTION
SCHEDULER = f"{xla_cpu.SCHEDULER_FLAG}={xla_cpu.MEMORY_OPTIMIZED}"
LOOP_EMITTERS = f"{xla_cpu.FUSION_EMITTERS_FLAG}=false"


def test_adds_every_setting_to_flags_without_them():
    out = xla_cpu.cpu_flags("--xla_force_host_platform_device_count=8", 4096)
    assert out == (f"--xla_force_host_platform_device_count=8 --xla_backend_extra_options={OPTION}=4096 {SCHEDULER} "
                   f"{LOOP_EMITTERS}")
    assert xla_cpu.cpu_flags("", 7, memory_scheduler=False) == f"--xla_backend_extra_options={OPTION}=7 {LOOP_EMITTERS}"
    assert xla_cpu.cpu_flags("", 7, loop_emitters=False) == f"--xla_backend_extra_options={OPTION}=7 {SCHEDULER}"


def test_extends_existing_extra_options_instead_of_adding_a_second_flag():
    out = xla_cpu.cpu_flags("--xla_backend_extra_options=xla_cpu_foo=1 --xla_dump_to=/tmp/d", 64, loop_emitters=False)
    assert out == f"--xla_backend_extra_options=xla_cpu_foo=1,{OPTION}=64 --xla_dump_to=/tmp/d {SCHEDULER}"


def test_settings_already_made_stand():
    flags = (f"--xla_backend_extra_options={OPTION}=0 {xla_cpu.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_DEFAULT "
             f"{xla_cpu.FUSION_EMITTERS_FLAG}=true")
    assert xla_cpu.cpu_flags(flags, 1 << 20) == flags


@pytest.mark.parametrize("limit", [-1, True])
def test_rejects_a_limit_that_is_not_a_byte_count(limit):
    with pytest.raises(ValueError, match="non-negative int"):
        xla_cpu.cpu_flags("", limit)


def test_configure_after_jax_started_is_an_error():
    jax.devices()  # the test session's backend is up
    with pytest.raises(RuntimeError, match="before JAX's first computation"):
        xla_cpu.configure()
    with pytest.raises(RuntimeError, match=r"emulate_cpu_devices\(\) must run before"):
        xla_cpu.emulate_cpu_devices(4)


@pytest.mark.parametrize("count", [0, -2, True])
def test_rejects_a_device_count_that_is_not_positive(count):
    with pytest.raises(ValueError, match="positive int"):
        xla_cpu.emulate_cpu_devices(count)


@pytest.mark.parametrize("xla_flags,expected", [("", 3), (f"{xla_cpu.DEVICE_COUNT_FLAG}=2", 2)])
def test_emulated_device_count_unless_xla_flags_force_one(xla_flags, expected):
    """In a fresh process (this one's backend is up): the count asked for, or the caller's own."""
    script = "from jtopoep import xla_cpu; xla_cpu.emulate_cpu_devices(3); import jax; print(jax.device_count())"
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == str(expected)


def test_planner_loops_without_sorts_compile_to_one_kernel():
    """conftest configured this process's small-loop limit as the trainer does; XLA marks a loop it
    compiled into one kernel with the xla_cpu_small_call attribute. eplb's replica loop and taot's
    Sinkhorn iterations must be one (with the limit at 2000 bytes neither is). topoep's and taot's
    rounds hold sorts and scatters, which the pass leaves out: they run as graphs of kernels, a
    fixed few rounds of them. Compiled with the fusion emitters: the loop emitters expand each
    scatter into a small loop of its own, which the pass makes one kernel too."""
    for name, loops in (("eplb", 1), ("taot", 1)):
        planner = get_planner(name, topology=Topology.preset("cpu-2x4"), num_experts=16, guest_slots=2)
        hlo = jax.jit(planner).lower(jnp.ones((8, 16), jnp.int32)).compile(FUSION_EMITTERS).as_text()
        assert hlo.count('xla_cpu_small_call="true"') == loops, name
