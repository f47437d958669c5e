"""A log line or trace cut short by a crash costs a warning on resume, never the run."""

import numpy as np
import pytest

from train import records
from train.checkpoint import RunWarning


def test_a_truncated_log_keeps_its_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = "".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 6))
    path.write_text(lines[: len(lines) - 9])  # the last row cut mid-way
    with pytest.warns(RunWarning, match="line 5 is damaged"):
        records.keep_rows(path, 3)
    assert [r["step"] for r in records.read_rows(path)] == [1, 2, 3]


def test_a_truncated_trace_is_kept_aside_and_restarted(tmp_path):
    path = tmp_path / "counts.npz"
    placements = [np.full((2, 8, 2), s) for s in range(4)]
    records.write_trace(path, [np.full((2, 8, 16), s) for s in range(4)], [1, 1, 2, 2], placements)
    counts, steps, kept = records.read_trace(path, 1)
    assert steps == [1, 1] and np.array_equal(counts[1], np.full((2, 8, 16), 1))
    assert len(kept) == 2 and np.array_equal(kept[1], placements[1])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.warns(RunWarning, match="counts.npz is damaged .*kept as counts.npz.damaged"):
        assert records.read_trace(path, 2) == ([], [], [])
    assert (tmp_path / "counts.npz.damaged").exists() and not path.exists()
