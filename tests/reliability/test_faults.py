"""Faults a long run meets: a signal, a damaged checkpoint, a full disk, NaN in the router. Each is
survived or stops the run with one clear line, and a resumed run ends bit for bit where an
uninterrupted one does."""

import errno
import os
import signal

import jax
import numpy as np
import pytest

from jtopoep.config import config_from_dict
from train.checkpoint import CheckpointError, RunWarning
from train.loop import NonFiniteLossError, Trainer
from train.signals import Interrupted


def tiny(tmp_path, name, steps=4):
    # The settings of test_train's default run, so that the two files share its compiled programs
    # (one compilation cache for the test run: tests/conftest.py).
    return config_from_dict({
        "topology": {"preset": "cpu-2x4"},
        "model": {"vocab_size": 64, "seq_len": 12, "d_model": 16, "num_layers": 2, "num_heads": 2,
                  "num_experts": 16, "top_k": 2, "expert_hidden": 12, "dense_hidden": 24},
        "moe": {"planner": "topoep", "guest_slots": 2, "price_transfers": False, "hierarchical": True,
                "recv_capacity_factor": 0, "guest_weight_chunks": 1, "score_fn": "sigmoid", "bias_balancing": True,
                "bias_update_rate": 0.01},
        "train": {"steps": steps, "batch_size": 16, "warmup_steps": 1, "learning_rate": 1e-2, "log_every": 1,
                  "eval_every": 0, "eval_batches": 1, "checkpoint_every": 2, "keep_checkpoints": 3,
                  "run_dir": str(tmp_path / name)},
        "data": {"source": "synthetic"},
    })


def parameters(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.model))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run: its losses and final parameters."""
    trainer = Trainer(tiny(tmp_path_factory.mktemp("straight"), "run"))
    trainer.run()
    return trainer


def losses(trainer):
    from train.records import read_rows
    return [row["loss"] for row in read_rows(trainer.run_dir / "metrics.jsonl")]


def test_sigterm_checkpoints_the_step_and_resumes_bitwise(devices, tmp_path, straight):
    trainer = Trainer(tiny(tmp_path, "run"))
    trainer.add_hook(lambda t, step, row: os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
    with pytest.raises(Interrupted, match="SIGTERM after step 3, with a checkpoint of it") as stop:
        trainer.run()
    assert stop.value.signum == signal.SIGTERM and trainer.checkpointer.latest_step() == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run
    resumed = Trainer(tiny(tmp_path, "run"))
    resumed.run()
    assert losses(resumed) == losses(straight)
    for a, b in zip(parameters(resumed), parameters(straight), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_checkpoint_falls_back_to_the_one_before(devices, tmp_path, straight):
    config = tiny(tmp_path, "run")
    Trainer(config).run()
    newest = tmp_path / "run" / "checkpoints" / "4"
    for path in sorted(p for p in newest.rglob("*") if p.is_file()):
        path.write_bytes(b"\0" * 7)  # every file of the newest checkpoint scrambled
    resumed = Trainer(config)
    with pytest.warns(RunWarning, match=r"checkpoint .*checkpoints/4 could not be read"):
        resumed.run()
    assert losses(resumed) == losses(straight)


def test_a_failed_checkpoint_write_stops_the_run_in_one_line(devices, tmp_path, monkeypatch):
    trainer = Trainer(tiny(tmp_path, "run"))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer.add_hook(lambda t, step, row: monkeypatch.setattr(t.checkpointer.manager, "save", disk_full)
                     if step == 3 else None)
    with pytest.raises(CheckpointError, match=r"the checkpoint of step 4 could not be written .*No space left on "
                                              r"device; the last good checkpoint is step 2"):
        trainer.run()
    assert trainer.checkpointer.latest_step() == 2


def test_nan_in_a_router_names_the_step_and_the_layer(devices, tmp_path):
    trainer = Trainer(tiny(tmp_path, "run"))

    def poison(t, step, row):
        if step == 2:
            router = t.model.moe_layer().router  # stacked over the MoE layers: poison layer 1's
            router.set_value(router.get_value().at[1, 0, 0].set(np.nan))

    trainer.add_hook(poison)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan at step 3; first at MoE layer 1 \(router "
                                                 r"logits\); last good checkpoint: step 2"):
        trainer.run()


def test_ranks_with_different_plans_stop_the_run(devices, tmp_path):
    """The step reports whether the ranks' plan fingerprints differed (jtopoep.plan.plan_fingerprint);
    the trainer stops on it before saving, naming the layer. Here the report is forged at step 3."""
    from train.loop import PlanMismatchError

    trainer = Trainer(tiny(tmp_path, "run"))
    step, calls = trainer.train_step, []

    def forged(*args):
        out = step(*args)
        calls.append(1)
        return {**out, "plans_differ": out["plans_differ"].at[0, 1].set(1)} if len(calls) == 3 else out

    trainer.train_step = forged
    with pytest.raises(PlanMismatchError, match="step 3: the ranks of MoE layer 1 computed different plans"):
        trainer.run()
    assert trainer.checkpointer.latest_step() == 2
