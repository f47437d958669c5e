"""Run folders: --fresh deletes only a jtopoep run, after every input is checked; a folder resumes only
the run it holds; files are written whole. No model is built here."""

import json
import os
import subprocess

import pytest

from jtopoep.config import config_from_dict, config_to_dict
from train import run_folder
from train.data import DataError
from train.loop import Trainer
from train.run_folder import RunFolderError

CONFIG = {"topology": {"preset": "cpu-2x4"}, "model": {"preset": "tiny"}, "data": {"source": "synthetic"}}


def a_run(folder):
    folder.mkdir(parents=True, exist_ok=True)
    run_folder.prepare(folder)
    (folder / "checkpoints").mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


@pytest.mark.parametrize("fresh", [True, False])
def test_a_folder_with_other_files_is_refused(tmp_path, fresh):
    folder = a_run(tmp_path / "run")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="not a jtopoep run folder .*notes.txt"):
        run_folder.check(folder, fresh=fresh)


def test_fresh_refuses_the_current_folder_its_parents_home_and_repositories(tmp_path, monkeypatch):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    for name in (".", str(inner), str(tmp_path)):
        with pytest.raises(RunFolderError, match="current folder or one above it"):
            run_folder.check(run_folder.pathlib.Path(name), fresh=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    with pytest.raises(RunFolderError, match="home folder"):
        run_folder.check(tmp_path / "home", fresh=True)
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    with pytest.raises(RunFolderError, match="git repository"):
        run_folder.check(repo, fresh=True)


def test_new_empty_and_run_folders_are_accepted(tmp_path):
    for fresh in (True, False):
        run_folder.check(tmp_path / "new" / "deeper", fresh)
        (tmp_path / "empty").mkdir(exist_ok=True)
        run_folder.check(tmp_path / "empty", fresh)
    folder = a_run(tmp_path / "run")
    run_folder.check(folder, fresh=True)
    run_folder.clear(folder)
    assert not folder.exists()
    # Written before the marker existed: config.json and checkpoints/ only.
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    assert run_folder.is_run_folder(legacy)


def test_a_file_or_an_unwritable_parent_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        run_folder.check(tmp_path / "file", fresh=False)
    with pytest.raises(RunFolderError, match="cannot be created"):
        run_folder.check(tmp_path / "file" / "run", fresh=False)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(RunFolderError, match="cannot be created"):
            run_folder.check(locked / "run", fresh=False)


def test_fresh_deletes_nothing_when_an_input_is_bad(tmp_path):
    folder = a_run(tmp_path / "run")
    raw = {**CONFIG, "train": {"run_dir": str(folder)}, "data": {"source": "path", "path": str(tmp_path / "nope")}}
    with pytest.raises(DataError, match="does not exist"):
        Trainer(config_from_dict(raw), fresh=True)
    assert (folder / "metrics.jsonl").exists()


def test_a_run_resumes_only_its_own_configuration(tmp_path):
    folder = a_run(tmp_path / "run")
    saved = config_to_dict(config_from_dict({**CONFIG, "train": {"run_dir": str(folder)}}))
    run_folder.write_atomic(folder / "config.json", json.dumps(saved))
    longer = config_from_dict({**CONFIG, "train": {"run_dir": str(folder), "steps": 500, "log_every": 1,
                                                   "checkpoint_every": 7}})
    run_folder.check_resumable(folder, config_to_dict(longer))  # length and logging may change
    other = config_from_dict({**CONFIG, "moe": {"planner": "taot"}, "model": {"preset": "tiny", "expert_hidden": 32},
                              "train": {"run_dir": str(folder)}})
    with pytest.raises(RunFolderError, match=r"another configuration \(model.expert_hidden: 64 -> 32; "
                                             r"moe.planner: 'topoep' -> 'taot'\); use a new train.run_dir, or --fresh"):
        run_folder.check_resumable(folder, config_to_dict(other))
    (folder / "config.json").write_text('{"model": ')
    with pytest.raises(RunFolderError, match="config.json is damaged"):
        run_folder.check_resumable(folder, config_to_dict(longer))


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    run_folder.write_atomic(path, "old")

    def crash(*_):
        raise OSError("No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        run_folder.write_atomic(path, "new")
    assert path.read_text() == "old"
    # The temporary left behind does not make the folder look foreign.
    assert (tmp_path / ".config.json.tmp").exists() and run_folder.foreign_entries(tmp_path) == []


def test_a_run_killed_while_writing_its_marker_is_still_its_own(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / f".{run_folder.MARKER}.tmp").write_text("jtopoep")  # the kill landed before the rename
    assert run_folder.is_run_folder(folder)
    for fresh in (True, False):
        run_folder.check(folder, fresh)
    run_folder.prepare(folder)
    assert (folder / run_folder.MARKER).is_file()
    # Another program's temporary is not the trainer's: refused, never deleted.
    (folder / ".notes.tmp").write_text("mine")
    with pytest.raises(RunFolderError, match=r"not a jtopoep run folder \(it holds .notes.tmp\)"):
        run_folder.check(folder, fresh=True)


def test_run_files_without_the_marker_are_refused_by_name(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunFolderError, match=r"it holds metrics.jsonl and no .jtopoep-run marker\)"):
        run_folder.check(folder, fresh=True)
