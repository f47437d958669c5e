"""SIGKILL at random points, several times in one run, during steps, checkpoint writes and log
writes alike: the run, resumed each time, ends with the same losses and bit-identical parameters as
an uninterrupted one.

Each case starts the trainer four times, so a test run takes a sample of the fault-injection cases
(fault_sample)."""

import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import child_env
from fault_sample import skip_unless_sampled

SEEDS = range(4)
KILLS = 2


def run_file(tmp_path, name):
    config = {
        "topology": {"preset": "cpu-2x4"},
        "model": {"vocab_size": 64, "seq_len": 12, "d_model": 16, "num_layers": 2, "num_heads": 2,
                  "num_experts": 16, "top_k": 2, "expert_hidden": 12, "dense_hidden": 24},
        # Kills across re-placements; eplb's step compiles faster than topoep's, and each of the
        # trainer's four starts traces it again (the compilation cache spares only XLA's part).
        "moe": {"planner": "eplb", "replace_every": 3, "guest_weight_chunks": 1},
        "train": {"steps": 8, "batch_size": 16, "warmup_steps": 2, "learning_rate": 1e-2, "log_every": 1,
                  "eval_every": 4, "eval_batches": 1, "checkpoint_every": 2, "run_dir": str(tmp_path / name)},
        "data": {"source": "synthetic"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(path, cache):
    # The children share a compilation cache, so that only the first compiles; each emulates its
    # own 8 devices.
    env = child_env(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen([sys.executable, "-m", "train", "--config", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(child):
    out = child.communicate(timeout=600)[0]
    assert child.returncode == 0, out[-3000:]


def final_parameters(run_dir):
    state = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / "8" / "default").resolve())
    return state["model"]


def losses(run_dir):
    from train.records import read_rows
    return [(row["step"], row["loss"], row.get("eval_loss")) for row in read_rows(run_dir / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_at_random_points_resumes_bitwise(devices, tmp_path, seed):
    skip_unless_sampled(f"sigkill-{seed}")
    cache = tmp_path / "cache"
    began = time.monotonic()
    finish(start(run_file(tmp_path, "straight"), cache))
    span = time.monotonic() - began  # compile included: the kills land anywhere in a run's life
    rng = np.random.default_rng(seed)
    path = run_file(tmp_path, "killed")
    for _ in range(KILLS):
        child = start(path, cache)
        time.sleep(rng.uniform(0.05, 0.5) * span)
        child.kill()
        child.communicate()
    finish(start(path, cache))
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    straight, killed = final_parameters(tmp_path / "straight"), final_parameters(tmp_path / "killed")
    import jax
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(killed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
