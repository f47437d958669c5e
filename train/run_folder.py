"""The run folder (train.run_dir): recognising a jtopoep run, starting over without deleting anything
else, resuming only the run it holds, and writing its files so that a crash leaves each whole.

A run folder holds a marker file, `.jtopoep-run`, and only the files the trainer writes. `--fresh`
deletes a folder only when it is recognisably such a run; it refuses the current folder, any folder
above it, the home folder, a git repository and any folder holding other files.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

MARKER = ".jtopoep-run"
RUN_FILES = frozenset({MARKER, "checkpoints", "metrics.jsonl", "counts.npz", "counts.npz.damaged", "config.json",
                       "report.png"})
# Keys that may change when a run resumes: its length and how often it logs, evaluates and saves.
RESUMABLE = frozenset({"train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                       "train.checkpoint_every", "train.keep_checkpoints", "train.run_dir"})


class RunFolderError(Exception):
    """A run folder that cannot be used as asked: the message says why and what to do instead."""


TEMPORARIES = frozenset(f".{name}.tmp" for name in RUN_FILES)  # left by an interrupted write_atomic
WRITTEN_BY_A_RUN = RUN_FILES | TEMPORARIES


def foreign_entries(folder: pathlib.Path) -> list[str]:
    """Names in folder that a jtopoep run does not write."""
    return sorted(p.name for p in folder.iterdir() if p.name not in WRITTEN_BY_A_RUN)


def is_run_folder(folder: pathlib.Path) -> bool:
    """A folder holding the marker (or, written before the marker existed, config.json and
    checkpoints/) and nothing a run does not write; or only the temporaries of a run killed before
    its marker landed."""
    if not folder.is_dir():
        return False
    names = {p.name for p in folder.iterdir()}
    if not names <= WRITTEN_BY_A_RUN:
        return False
    if names and names <= TEMPORARIES:
        return True
    return (folder / MARKER).is_file() or ((folder / "config.json").is_file() and (folder / "checkpoints").is_dir())


def _protected(folder: pathlib.Path) -> str | None:
    """Why folder must never be deleted, or None."""
    resolved, here = folder.resolve(), pathlib.Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        return "it is the current folder or one above it"
    if resolved == pathlib.Path.home().resolve():
        return "it is the home folder"
    if (resolved / ".git").exists():
        return "it is a git repository"
    return None


def check(folder: pathlib.Path, fresh: bool) -> None:
    """Refuse, before anything is written or deleted, a run folder this run must not use."""
    key = f"train.run_dir = {str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{key} is a file, not a folder: choose a folder path")
    if not folder.exists():
        parent = next(p for p in folder.absolute().parents if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise RunFolderError(f"{key} cannot be created: {parent} is not a writable folder")
        return
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RunFolderError(f"{key} is not writable: choose a folder you can write to")
    if fresh and (reason := _protected(folder)):
        raise RunFolderError(f"--fresh refuses to delete {key}: {reason}; name a run folder of its own")
    if not any(folder.iterdir()) or is_run_folder(folder):
        return
    foreign = foreign_entries(folder)
    listed = foreign or sorted(p.name for p in folder.iterdir())
    shown = ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "")
    missing = "" if foreign else f" and no {MARKER} marker"
    action = "--fresh refuses to delete" if fresh else "refusing to write into"
    raise RunFolderError(f"{action} {key}: it is not a jtopoep run folder (it holds {shown}{missing}); "
                         f"name a new or empty folder")


def clear(folder: pathlib.Path) -> None:
    """Delete a run folder that check(folder, fresh=True) accepted."""
    if folder.exists():
        shutil.rmtree(folder)


def prepare(folder: pathlib.Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / MARKER).exists():
        write_atomic(folder / MARKER, "jtopoep run folder: `python -m train --fresh` may delete it\n")


def _flatten(config: dict) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def differences(saved: dict, current: dict) -> list[str]:
    """'section.key: saved -> current' for every key that differs, less those that may change on resume."""
    old, new = _flatten(saved), _flatten(current)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if key not in RESUMABLE and old.get(key) != new.get(key)]


def check_resumable(folder: pathlib.Path, current: dict) -> None:
    """Refuse to continue a run folder whose saved configuration differs from this one."""
    path = folder / "config.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunFolderError(f"{path} is damaged ({err}); use a new train.run_dir, or --fresh to delete that "
                             f"run and start over") from err
    changed = differences(saved, current)
    if changed:
        shown = "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
        raise RunFolderError(f"{folder} holds a run with another configuration ({shown}); use a new "
                             f"train.run_dir, or --fresh to delete that run and start over")


def write_atomic(path: pathlib.Path, data: str | bytes) -> None:
    """Write path whole or not at all: a temporary file beside it, flushed, then renamed over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
