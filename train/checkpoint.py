"""Orbax checkpointing of model and optimizer state, resumed from the newest readable checkpoint."""

from __future__ import annotations

import pathlib
import warnings

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils


class RunWarning(UserWarning):
    """Something a run recovered from (a damaged checkpoint, log or trace) that the user should know."""


class CheckpointError(RuntimeError):
    """No checkpoint could be read, or one could not be written."""


class Checkpointer:
    def __init__(self, directory: pathlib.Path, keep: int):
        self.directory = directory.resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        state = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
        try:
            self.manager.save(step, args=ocp.args.StandardSave(state))
            # Saving is asynchronous; waiting here makes a failed write (a full disk) fail this step,
            # with the previous checkpoint intact, rather than surface later from a background thread.
            self.manager.wait_until_finished()
        except Exception as err:  # Orbax wraps the OSError in its own types
            raise CheckpointError(f"the checkpoint of step {step} could not be written to {self.directory}: "
                                  f"{_reason(err)}; the last good checkpoint is step "
                                  f"{self._last_complete(before=step)}") from err

    def _last_complete(self, before: int) -> int | None:
        steps = [s for s in self.manager.all_steps() if s < before]
        return max(steps) if steps else None

    def restore(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        model_state, opt_state = nnx.state(model), nnx.state(optimizer)
        target = {"model": nnx.to_pure_dict(model_state), "optimizer": nnx.to_pure_dict(opt_state)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)

    def restore_latest(self, model: nnx.Module, optimizer: nnx.Optimizer) -> int | None:
        """Restore the newest checkpoint that reads whole; a damaged one is skipped with a warning that
        names it. None when there is no checkpoint; CheckpointError when none reads."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        for step in steps:
            try:
                self.restore(step, model, optimizer)
                return step
            except Exception as err:  # any failure to read it: fall back to the one before
                # Moved aside, not deleted, so that the run can save this step again.
                aside = self.directory / f"damaged_step_{step}"
                if jax.process_index() == 0:  # one process moves it; the others wait for that
                    (self.directory / str(step)).rename(aside)
                multihost_utils.sync_global_devices(f"jtopoep: checkpoint {step} moved aside")
                self.manager.reload()
                warnings.warn(f"checkpoint {self.directory / str(step)} could not be read ({_reason(err)}); moved "
                              f"to {aside.name}, trying the one before it", RunWarning, stacklevel=2)
        if steps:
            raise CheckpointError(f"no checkpoint in {self.directory} could be read (steps {steps}); use --fresh "
                                  f"to start the run over")
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _reason(err: BaseException) -> str:
    """The innermost cause's message, on one line."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"
