"""A process of a multi-process run killed mid-run: the other stops within --peer-timeout with one
line, instead of waiting forever in a collective or being aborted by XLA."""

import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import child_env, free_port
from fault_sample import skip_unless_sampled


@pytest.mark.slow
def test_a_killed_peer_stops_the_other_process_with_one_line(devices, tmp_path):
    skip_unless_sampled("killed-peer")
    config = {
        "topology": {"preset": "cpu-2x4"},
        "model": {"vocab_size": 64, "seq_len": 12, "d_model": 16, "num_layers": 1, "num_heads": 2,
                  "num_experts": 16, "top_k": 2, "expert_hidden": 12, "dense_hidden": 24},
        "moe": {"planner": "none"},
        "train": {"steps": 1000, "batch_size": 16, "warmup_steps": 1, "log_every": 1, "eval_every": 1000,
                  "checkpoint_every": 1000, "run_dir": str(tmp_path / "run")},
        "data": {"source": "synthetic"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    port, env = free_port(), child_env()
    children = [subprocess.Popen([sys.executable, "-m", "train", "--config", str(tmp_path / "run.yaml"),
                                  "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
                                  "--peer-timeout", "8"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and children[0].poll() is None, (
                "the run never got going: " + (children[0].stderr.read()[-3000:] if children[0].poll() is not None
                                               else "no third step logged in 300 s"))
            time.sleep(0.5)
        children[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        err = children[0].communicate(timeout=120)[1]
        waited = time.monotonic() - killed
    finally:
        for child in children:
            child.kill()
    # The watchdog's line when the survivor waits in a collective; the supervisor's when the
    # transport aborts it (Gloo does when the dead peer's half-sent data arrives).
    assert children[0].returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and ("has died or hangs" in lines[0] or "peer died" in lines[0]), err[-3000:]
    assert err.rstrip().splitlines()[-1] == lines[0]
    assert waited < 60
