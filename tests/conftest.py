"""Every test sees 8 emulated CPU devices; set before JAX initialises a backend."""

import os
import sys

# The tests check results, not speed, and most of an XLA:CPU compile here is LLVM optimising the
# generated code: without it the suite's many small compiles take about a third less time.
TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
# Compiler options for a test that inspects a compiled planner's structure as a GPU has it: XLA's
# fusion emitters keep each scatter one kernel, where the loop emitters that xla_cpu.configure()
# chooses expand it into a loop of its own.
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f and f not in TEST_XLA_FLAGS]
    + TEST_XLA_FLAGS + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the run, shared by the xdist workers (which inherit this environment):
# many tests build the same tiny model, and a program one worker compiled the other loads. A fresh
# folder per run, removed at its end, so nothing carries over between runs.
_RUN_CACHE = "JTOPOEP_TESTS_COMPILATION_CACHE"  # names the run's cache to the workers
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    import tempfile

    _OWN_CACHE = tempfile.mkdtemp(prefix="jtopoep-tests-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE] = _OWN_CACHE
# Test helpers (planner_cases, routing_oracle, test_dispatch's oracle) import from tests/ subfolders too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from jtopoep import xla_cpu  # noqa: E402

# The trainer's XLA:CPU settings, less the memory-optimised scheduler: it changes no result (plans and
# training losses are bitwise the same) but compiles more slowly, and this suite of many small
# compiles took 7.6 minutes with it against 6.5 without.
xla_cpu.configure(memory_scheduler=False)

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests need 8 emulated CPU devices, got {len(devs)}"
    return devs


def child_env(**extra) -> dict:
    """The environment for a trainer started as a child process: this one's, less the emulated
    device count, so the child emulates its own share of the mesh."""
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if "device_count" not in f)
    env = {**os.environ, "XLA_FLAGS": flags}
    if _RUN_CACHE in env and env.get("JAX_COMPILATION_CACHE_DIR") == env[_RUN_CACHE]:
        # Not the run's cache: processes of one multi-process run compile the same program at the same
        # time, and one must not load an entry the other is still writing. A caller may pass its own.
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return {**env, **extra}


def free_port() -> int:
    """A localhost port nothing listens on, for a multi-process run's coordinator."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
