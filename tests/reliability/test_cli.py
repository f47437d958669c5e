"""The command line: bad input is one line and exit status 2, --debug shows the traceback, numbers
parse in every form, and overrides are checked together."""

import pytest
import yaml

from jtopoep.config import ConfigError, load_config
from train.__main__ import main

RUN = {"topology": {"preset": "cpu-2x4"}, "model": {"preset": "tiny"}, "moe": {"planner": "topoep"},
       "train": {"steps": 300, "warmup_steps": 20}, "data": {"source": "synthetic"}}


def run_file(tmp_path, data=RUN):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("text", ["3e-4", "1E3", ".5", "+2.", "155.0e9", "7"])
def test_numbers_parse_in_every_form(tmp_path, text):
    config = load_config(run_file(tmp_path), [f"train.learning_rate={text}"])
    assert config.train.learning_rate == float(text)


def test_a_negative_number_is_refused_for_its_value_not_its_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train.learning_rate = -0.001 is not allowed: expected a value > 0"):
        load_config(run_file(tmp_path), ["train.learning_rate=-1e-3"])


def test_overrides_are_checked_together(tmp_path):
    # A run shorter than the file's warm-up ends within it; no second override needed.
    assert load_config(run_file(tmp_path), ["train.steps=20"]).train.steps == 20
    # Planner none never fills guest slots, so the file's guest_slots need not change with it.
    assert load_config(run_file(tmp_path), ["moe.planner=none"]).moe.planned_guest_slots == 0


@pytest.mark.parametrize("args,message", [
    (["--set", "train.learning_rate=fast"], "train.learning_rate = 'fast' has type str: expected float"),
    (["--set", "moe.planner=greedy"], "moe.planner = 'greedy' is not allowed: expected one of"),
    (["--set", "train.run_dir=[1"], "the value is not valid YAML"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, args, message):
    assert main(["--config", run_file(tmp_path)] + args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_yaml_syntax_error_names_the_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("topology:\n  preset: cpu-2x4\nmodel: [\n")
    assert main(["--config", str(path)]) == 2
    assert "is not valid YAML at line 4" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError):
        main(["--config", run_file(tmp_path), "--set", "moe.planner=greedy", "--debug"])


def test_a_partial_multi_process_command_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--config", run_file(tmp_path), "--num-processes", "2"])
    assert stop.value.code == 2
    assert "needs all of --coordinator, --num-processes and --process-id" in capsys.readouterr().err


def test_data_under_a_folder_named_test_is_read(tmp_path):
    from jtopoep.config import DataConfig
    from train.data import ByteDataset, DataError

    root = tmp_path / "test" / "corpus"
    root.mkdir(parents=True)
    (root / "a.txt").write_text("some text to learn from " * 40)
    (root / "b.txt").write_text("and a held out file " * 40)
    data = ByteDataset(DataConfig(source="path", path=str(root), eval_fraction=0.5), 16, 256)
    assert len(data.train) + len(data.eval) > 1000
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        ByteDataset(DataConfig(source="path", path=str(tmp_path / "empty")), 16, 256)
    with pytest.raises(DataError, match="is a file"):
        ByteDataset(DataConfig(source="path", path=str(root / "a.txt")), 16, 256)


def test_a_lone_process_of_a_two_process_run_stops_in_bounded_time(tmp_path):
    """Its peer never comes: it gives up after --connect-timeout with one line, not a silent hang."""
    import subprocess
    import sys

    from conftest import child_env, free_port

    port, env = free_port(), child_env()
    out = subprocess.run([sys.executable, "-m", "train", "--config", run_file(tmp_path), "--coordinator",
                          f"localhost:{port}", "--num-processes", "2", "--process-id", "0", "--connect-timeout", "3"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "could not join the 2-process run" in out.stderr and "Traceback" not in out.stderr
