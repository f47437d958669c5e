"""Orbax checkpointing of model and optimizer state, resumed from the latest step."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:
    def __init__(self, directory: pathlib.Path, keep: int):
        self.manager = ocp.CheckpointManager(
            directory.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        state = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        model_state, opt_state = nnx.state(model), nnx.state(optimizer)
        target = {"model": nnx.to_pure_dict(model_state), "optimizer": nnx.to_pure_dict(opt_state)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
