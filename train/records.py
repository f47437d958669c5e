"""The run's records beside its checkpoints: metrics.jsonl and the routing trace counts.npz, read
back on resume so that a line or trace cut short by a crash costs a warning, never the run."""

from __future__ import annotations

import io
import json
import os
import pathlib
import warnings

import numpy as np

from train import run_folder
from train.checkpoint import RunWarning


def read_rows(path: pathlib.Path) -> list[dict]:
    """The rows of metrics.jsonl that parse; any other line (the tail of a write cut short) is
    dropped with a warning naming it."""
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            warnings.warn(f"{path}: line {number} is damaged and was dropped", RunWarning, stacklevel=2)
    return rows


def keep_rows(path: pathlib.Path, step: int) -> None:
    """Cut metrics.jsonl back to the rows up to `step` (what was logged after the checkpoint a run
    resumes from is logged again)."""
    if path.exists():
        rows = [row for row in read_rows(path) if row["step"] <= step]
        run_folder.write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def append_row(path: pathlib.Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_trace(path: pathlib.Path, step: int) -> tuple[list[np.ndarray], list[int], list[np.ndarray]]:
    """The routing trace's entries up to `step`: counts [layers, R, E], step, and the placements
    [layers, R, H] they were routed under (empty for a trace that predates them). A damaged trace is
    kept aside as counts.npz.damaged, with a warning, and the trace starts again after this step."""
    if not path.exists():
        return [], [], []
    try:
        with np.load(path) as trace:
            # By step, not by position: the run may have had another train.microbatches before. A
            # trace without steps predates micro-batches: one entry per step.
            steps = trace["step"] if "step" in trace else np.arange(1, len(trace["counts"]) + 1)
            kept = steps <= step
            placements = list(trace["placement"][kept]) if "placement" in trace else []
            return list(trace["counts"][kept]), steps[kept].tolist(), placements
    except Exception as err:  # BadZipFile, EOFError, a missing or malformed array: all mean damaged
        os.replace(path, path.with_name(path.name + ".damaged"))
        warnings.warn(f"{path} is damaged ({type(err).__name__}); kept as {path.name}.damaged, and the trace "
                      f"starts again after step {step}", RunWarning, stacklevel=2)
        return [], [], []


def write_trace(path: pathlib.Path, counts: list[np.ndarray], steps: list[int],
                placements: list[np.ndarray] | None = None) -> None:
    """Write the trace; placements (one per entry) are kept when there is one for every entry."""
    arrays = {"counts": np.stack(counts).astype(np.int32), "step": np.asarray(steps, np.int32)}
    if placements and len(placements) == len(counts):
        arrays["placement"] = np.stack(placements).astype(np.int32)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    run_folder.write_atomic(path, buffer.getvalue())
