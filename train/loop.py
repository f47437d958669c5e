"""The training loop: mesh, sharded model, jitted step, evaluation, checkpoints, logs and report.

`Trainer(config).run()` trains; `add_hook(fn, every=n)` extends it without copying it. The jitted step
does everything on device (forward, planner, dispatch, backward, optimizer, router-bias update); the
host reads back only the scalars and counts it logs.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pathlib
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint import multihost as ocp_multihost
from tqdm import tqdm

from jtopoep.config import MoEConfig, RunConfig, config_to_dict
from jtopoep.costmodel import MIGRATED_BYTES_PER_ELEMENT
from jtopoep.layer import ExpertParam
from jtopoep.migration import rehome
from jtopoep.router import bias_update
from jtopoep.topology import make_mesh
from models.moe_transformer import EXPERT_SPEC, MoETransformer
from train import records, run_folder
from train.checkpoint import Checkpointer
from train.data import ByteDataset
from train.report import write_report
from train.signals import Interrupted, StopSignals
from train.watchdog import Watchdog


class NonFiniteLossError(FloatingPointError):
    """A step's loss or gradient was not finite; nothing of that step was saved."""


class PlanMismatchError(RuntimeError):
    """The ranks of an expert-parallel group computed different plans."""


class ReceiveCapacityError(RuntimeError):
    """A plan sent some rank more pairs than its receive buffer holds (moe.recv_capacity_factor), and
    moe.on_overflow is "error"."""


class OverflowWarning(UserWarning):
    """A step dropped more pairs than train.overflow_warn_fraction of a layer's pairs."""


def make_optimizer(config: RunConfig) -> optax.GradientTransformation:
    t = config.train
    return _adamw(t.learning_rate, t.warmup_steps, t.steps, t.grad_clip, t.weight_decay)


@functools.lru_cache(maxsize=None)
def _adamw(learning_rate: float, warmup_steps: int, steps: int, grad_clip: float,
           weight_decay: float) -> optax.GradientTransformation:
    """One transformation object per setting: it is part of the optimizer's static structure, so
    trainers with equal settings share the jitted step's compiled code."""
    if warmup_steps >= steps:  # a run shorter than its warm-up ends while the rate still rises
        schedule = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
    else:
        schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, steps,
                                                      end_value=learning_rate * 0.1)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    return optax.chain(*parts, optax.adamw(schedule, weight_decay=weight_decay))


def create_sharded_model(config: RunConfig, topology, mesh) -> MoETransformer:
    """The model with every parameter created in place on its shards: expert weights split over
    ("node", "gpu") on their expert axis, everything else replicated.

    Initialisation runs as one jitted program whose outputs carry these shardings, so XLA creates
    each device's shard where it lives (JAX's random bits are partitionable) and no device ever holds
    a whole expert tensor. Building the model eagerly and then moving it would first put all of it on
    one device: DeepSeek-V2-Lite's experts alone are 58 GB in float32, more than an H800 holds. In a
    multi-host run every process computes just its own shards, where moving a host-local model onto
    devices of other processes is not possible at all."""
    experts = NamedSharding(mesh, EXPERT_SPEC)
    replicated = NamedSharding(mesh, P())

    @nnx.jit
    def create():
        model = MoETransformer(config.model, config.moe, topology, mesh, rngs=nnx.Rngs(config.train.seed))
        nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model, ExpertParam), experts))
        nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model, nnx.Not(ExpertParam)), replicated))
        return model

    return create()


def replicate_unplaced(module: nnx.Module, mesh) -> None:
    """Replicate state that was created on one device (optimizer step counters) over the mesh, so
    the first step compiles for the same shardings every later step sees."""
    state = nnx.state(module)
    replicated = NamedSharding(mesh, P())
    placed = jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                          else jax.device_put(x, replicated), state)
    nnx.update(module, placed)


def _losses(model, tokens, moe, previous=None):
    logits, stats = model(tokens[:, :-1], previous)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()
    aux, z = stats["aux_loss"].sum(), stats["z_loss"].sum()
    loss = ce + moe.aux_loss_coef * aux + moe.z_loss_coef * z
    return loss, (ce, stats)


def accumulated_grads(model, tokens, moe: MoEConfig):
    """(mean loss, mean cross-entropy, per-micro-batch layer stats, gradient of the mean loss) of
    tokens [M, b, L+1], one micro-batch after another (jax.lax.scan): each is routed, planned and
    dispatched on its own, and only one micro-batch's activations are live at a time. The stats are
    the layers' stats [layers, ...] with a leading micro-batch axis [M, layers, ...]. M = 1 is the
    plain step, with no scan.

    With moe.keep_copies, each MoE layer's guest copies go from one micro-batch to the next in the
    scan's carry, so copies held again are not fetched again (jtopoep.guests); every step starts
    with none, since the optimizer update changes the weights."""
    if tokens.shape[0] == 1:
        grad_fn = nnx.value_and_grad(lambda m: _losses(m, tokens[0], moe), has_aux=True)
        (loss, (ce, stats)), grads = grad_fn(model)
        return loss, ce, jax.tree.map(lambda a: a[None], stats), grads
    keep = moe.keep_copies and model.moe_layer().makes_copies
    held = model.no_guest_copies() if keep else None
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_batch(carry, toks):
        total, held = carry
        loss_of = lambda p: _losses(nnx.merge(graphdef, p, rest), toks, moe, held)  # noqa: E731
        (loss, (ce, stats)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        held = stats.pop("guests") if keep else None
        return (jax.tree.map(jnp.add, total, grads), held), (loss, ce, stats)

    (total, _), (loss, ce, stats) = jax.lax.scan(micro_batch, (jax.tree.map(jnp.zeros_like, params), held), tokens)
    count = tokens.shape[0]
    return loss.mean(), ce.mean(), stats, jax.tree.map(lambda g: g / count, total)


@functools.lru_cache(maxsize=None)
def make_train_step(moe: MoEConfig, mesh):
    """The jitted step for one MoE config and mesh; cached so that trainers of the same model share
    compiles. tokens [M, b, L+1]: M micro-batches whose gradients are averaged into one update
    (accumulated_grads). What it returns for the host is replicated over the mesh, so that every
    process of a multi-host run can read it (an array with shards on other processes' devices cannot
    be fetched); its per-layer arrays have a leading micro-batch axis."""
    replicated = NamedSharding(mesh, P())

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, ce, stats, grads = accumulated_grads(model, tokens, moe)
        optimizer.update(model, grads)
        layers = model.moe_layer()  # every MoE layer's variables, stacked [layers, ...]
        if moe.replace_every:  # the averages a re-placement reads, from all micro-batches of the step
            layers.observe(stats["loads"].sum(0), stats["coactivation"].sum(0))
        if moe.bias_balancing:
            # One bias update per optimizer step, from the loads of all its micro-batches.
            update = jax.vmap(lambda bias, counts: bias_update(bias, counts, moe.bias_update_rate))
            layers.bias.set_value(update(layers.bias.get_value(), stats["counts"].sum(0)))
        per_layer = ("imbalance_before", "imbalance_after", "inter_node_pairs", "scaleout_rows", "counts", "dropped_pairs",
                     "guest_copies", "kept_copies", "nonfinite_router", "nonfinite_output", "plans_differ")
        summary = {"loss": loss, "ce": ce, **{k: stats[k] for k in per_layer}}
        summary["grads_finite"] = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        return jax.lax.with_sharding_constraint(summary, replicated)

    return train_step


@functools.lru_cache(maxsize=None)
def make_rehome_step(moe: MoEConfig, mesh):
    """The jitted re-placement (moe.replace_every): every MoE layer's new placement, its expert
    weights and their AdamW moments migrated (jtopoep.migration.rehome). Returns, replicated, per
    layer the placement [layers, R, H], which experts moved [layers, E] and how many moved within a
    node and across nodes."""
    replicated = NamedSharding(mesh, P())

    @nnx.jit
    def rehome_step(model, optimizer):
        out = rehome(model, optimizer, backend=moe.transport)
        out["placement"] = model.moe_layer().placement.get_value()
        return jax.lax.with_sharding_constraint(out, replicated)

    return rehome_step


@functools.lru_cache(maxsize=None)
def make_eval_step(moe: MoEConfig, mesh):
    replicated = NamedSharding(mesh, P())

    @nnx.jit
    def eval_step(model, tokens):
        _, (ce, stats) = _losses(model, tokens, moe)
        dropped = stats["dropped_pairs"].sum()
        return jax.lax.with_sharding_constraint((ce, dropped), replicated)

    return eval_step


@dataclasses.dataclass
class Hook:
    fn: Callable[["Trainer", int, dict], None]
    every: int


class Trainer:
    def __init__(self, config: RunConfig, fresh: bool = False, peer_timeout: float = 300.0,
                 start_timeout: float = 120.0):
        """peer_timeout: in a multi-process run, seconds without a finished step (after the first,
        which compiles) before this process stops, taking a peer for dead. start_timeout: how far
        apart the processes may finish building their data and model (on a loaded host, more than a
        short peer_timeout); the barrier before the first collective waits the longer of the two."""
        self.config = config
        self.peer_timeout = peer_timeout
        self.run_dir = pathlib.Path(config.train.run_dir)
        # In a multi-host run every process trains, Orbax writes checkpoints from all of them, and
        # process 0 alone writes the run directory's logs, trace and report (a shared file system).
        self.is_main = jax.process_index() == 0
        # Every input is checked before anything is deleted or written: the folder, the data, and on
        # resume that the folder holds this same run.
        run_folder.check(self.run_dir, fresh)
        self.data = ByteDataset(config.data, config.model.seq_len, config.model.vocab_size, config.train.seed)
        if not fresh:
            run_folder.check_resumable(self.run_dir, config_to_dict(config))
        if fresh and self.is_main:
            run_folder.clear(self.run_dir)
        if fresh:
            multihost_utils.sync_global_devices("jtopoep: run directory cleared")
        if self.is_main:
            run_folder.prepare(self.run_dir)
        self.topology = config.topology.to_topology()
        self.mesh = make_mesh(self.topology, data=config.topology.data_parallel)
        self.batch_sharding = NamedSharding(self.mesh, P(self.mesh.axis_names))
        self.micro_batch_sharding = NamedSharding(self.mesh, P(None, self.mesh.axis_names))
        self.model = create_sharded_model(config, self.topology, self.mesh)
        self.optimizer = nnx.Optimizer(self.model, make_optimizer(config), wrt=nnx.Param)
        if jax.process_count() > 1:
            # The first collective follows; Gloo gives a late peer only 30 s there, and processes
            # that build data and compile under load can be further apart. The distributed
            # service's barrier waits longer instead.
            ocp_multihost.sync_global_processes("jtopoep: model created", timeout=int(max(peer_timeout, start_timeout)),
                                                processes=set(range(jax.process_count())))
        replicate_unplaced(self.optimizer, self.mesh)
        self._host_placement: np.ndarray | None = None
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", config.train.keep_checkpoints)
        self.train_step = make_train_step(config.moe, self.mesh)
        self.eval_step = make_eval_step(config.moe, self.mesh)
        self.rehome_step = make_rehome_step(config.moe, self.mesh) if config.moe.replace_every else None
        self.hooks: list[Hook] = []
        # The routing trace: [layers, R, E] per micro-batch, and the step each belongs to.
        self.counts: list[np.ndarray] = []
        self.count_steps: list[int] = []
        self.placements: list[np.ndarray] = []  # [layers, R, H] each entry was routed under

    def add_hook(self, fn: Callable[["Trainer", int, dict], None], every: int = 1) -> None:
        """Call fn(trainer, step, metrics) after every `every`-th step."""
        if every < 1:
            raise ValueError(f"every = {every} must be >= 1")
        self.hooks.append(Hook(fn, every))

    def _device_batch(self, step: int, split: str = "train") -> jax.Array:
        """The step's batch [B, L+1]; for training, split into micro-batches [M, B / M, L+1]."""
        batch = self.data.batch(step, self.config.train.batch_size, split)
        sharding = self.batch_sharding
        if split == "train":
            batch = batch.reshape(self.config.train.microbatches, -1, batch.shape[-1])
            sharding = self.micro_batch_sharding
        # Each process supplies only the shards it holds, so the same code runs on one host or many.
        return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])

    def evaluate(self) -> float:
        results = jax.device_get([self.eval_step(self.model, self._device_batch(i, "eval"))
                                  for i in range(self.config.train.eval_batches)])
        if self.config.moe.on_overflow == "error" and any(dropped for _, dropped in results):
            raise ReceiveCapacityError(f"evaluation: a plan sent some rank more pairs than its receive buffer holds "
                                       f"(moe.recv_capacity_factor = {self.config.moe.recv_capacity_factor}); "
                                       f"raise it, set it to 0 for room for every pair, or set moe.on_overflow: drop")
        return float(np.mean([ce for ce, _ in results]))

    def _resume(self) -> int:
        """Restore the newest readable checkpoint and cut the log and trace back to its step."""
        step = self.checkpointer.restore_latest(self.model, self.optimizer)
        self._host_placement = None
        metrics_path, trace_path = self.run_dir / "metrics.jsonl", self.run_dir / "counts.npz"
        if step is None:
            if self.is_main:
                metrics_path.unlink(missing_ok=True)
                trace_path.unlink(missing_ok=True)
            return 0
        if self.is_main:  # the one process that writes the log and the trace reads them back
            records.keep_rows(metrics_path, step)
            self.counts, self.count_steps, self.placements = records.read_trace(trace_path, step)
        return step

    def _save(self, step: int) -> None:
        """Checkpoint `step` (unless it already is) and write the trace up to it."""
        if self.checkpointer.latest_step() != step:
            self.checkpointer.save(step, self.model, self.optimizer)
        if self.is_main and self.counts:
            records.write_trace(self.run_dir / "counts.npz", self.counts, self.count_steps, self.placements)

    def _last_good(self) -> str:
        step = self.checkpointer.latest_step()
        return "none yet" if step is None else f"step {step}"

    def _check(self, summary: dict, step: int) -> None:
        """Refuse a step whose numbers are not finite or whose plans did not fit, before anything of
        it is saved: the last checkpoint stays the last good state."""
        good = f"last good checkpoint: {self._last_good()}"
        output = np.asarray(summary["nonfinite_output"]).any(0)  # per layer, over the micro-batches
        router = np.asarray(summary["nonfinite_router"]).any(0)
        where = ""
        if router.any() or output.any():
            layer = int(np.flatnonzero(router | output)[0])
            where = f"; first at MoE layer {layer} ({'router logits' if router[layer] else 'its output'})"
        if not np.isfinite(summary["loss"]):
            raise NonFiniteLossError(f"non-finite loss {summary['loss']} at step {step}{where}; {good}")
        if not summary["grads_finite"]:
            raise NonFiniteLossError(f"non-finite gradient at step {step}{where}; {good}")
        differ = np.asarray(summary["plans_differ"]).any(0)
        if differ.any():
            raise PlanMismatchError(f"step {step}: the ranks of MoE layer {int(np.flatnonzero(differ)[0])} computed "
                                    f"different plans (their fingerprints differ), so their exchanges would not "
                                    f"match; {good}")
        dropped = np.asarray(summary["dropped_pairs"]).sum(0)  # per layer, over the micro-batches
        if not dropped.any():
            return
        layer = int(np.argmax(dropped))
        moe = self.config.moe
        what = (f"MoE layer {layer} planned more pairs for some rank than its receive buffer holds "
                f"({int(dropped[layer])} pairs did not fit; moe.recv_capacity_factor = {moe.recv_capacity_factor})")
        if moe.on_overflow == "error":
            # Pairs that did not fit a receive buffer were not computed: refuse the step.
            raise ReceiveCapacityError(f"step {step}: {what}; raise moe.recv_capacity_factor, set it to 0 for "
                                       f"room for every pair, or set moe.on_overflow: drop; {good}")
        m = self.config.model
        pairs = self.config.train.batch_size * m.seq_len * m.top_k // self.config.topology.data_parallel
        limit = self.config.train.overflow_warn_fraction
        if dropped[layer] > limit * pairs:
            warnings.warn(f"step {step}: {what}, {dropped[layer] / pairs:.2%} of its pairs, more than "
                          f"train.overflow_warn_fraction = {limit}; they added nothing to their tokens",
                          OverflowWarning, stacklevel=2)

    def _step(self, step: int) -> dict:
        """Train one step, check it, and return its metrics row."""
        t = self.config.train
        began = time.perf_counter()
        summary = jax.device_get(self.train_step(self.model, self.optimizer, self._device_batch(step)))
        seconds = time.perf_counter() - began
        done = step + 1
        self._check(summary, done)
        self.counts.extend(np.asarray(summary["counts"]))  # one [layers, R, E] entry per micro-batch
        self.count_steps.extend([done] * t.microbatches)
        self.placements.extend([self._placement()] * t.microbatches)
        # Per layer: imbalance averaged over the step's micro-batches, pairs and copies summed.
        row = {"step": done, "loss": float(summary["loss"]), "ce": float(summary["ce"]),
               "tokens_per_s": t.batch_size * self.config.model.seq_len / seconds, "step_s": seconds,
               "imbalance_before": np.asarray(summary["imbalance_before"]).mean(0).round(4).tolist(),
               "imbalance_after": np.asarray(summary["imbalance_after"]).mean(0).round(4).tolist(),
               "inter_node_pairs": np.asarray(summary["inter_node_pairs"]).sum(0).tolist(),
               # Token rows that crossed nodes (one per token and node reached with moe.hierarchical),
               # and pairs dropped for want of receive-buffer room (moe.on_overflow).
               "scaleout_rows": np.asarray(summary["scaleout_rows"]).sum(0).tolist(),
               "dropped_pairs": np.asarray(summary["dropped_pairs"]).sum(0).tolist(),
               # Guest copies made, and those kept from the step's previous micro-batch (not fetched).
               "guest_copies": np.asarray(summary["guest_copies"]).sum(0).tolist(),
               "kept_copies": np.asarray(summary["kept_copies"]).sum(0).tolist()}
        if self.rehome_step is not None and done % self.config.moe.replace_every == 0 and done < t.steps:
            row.update(self._rehome())
        if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
            row["eval_loss"] = self.evaluate()
        return row

    def _placement(self) -> np.ndarray:
        """[layers, R, H]: each MoE layer's home placement now (a host copy, read after a change)."""
        if self._host_placement is None:
            self._host_placement = np.asarray(jax.device_get(self.model.moe_layer().placement.get_value()))
        return self._host_placement

    def _rehome(self) -> dict:
        """Move the home experts (moe.replace_every); what moved, for the metrics row."""
        result = jax.device_get(self.rehome_step(self.model, self.optimizer))
        self._host_placement = np.asarray(result["placement"])
        m = self.config.model
        expert_bytes = 3 * m.d_model * m.expert_hidden * MIGRATED_BYTES_PER_ELEMENT
        return {"moved_experts": [np.flatnonzero(moved).tolist() for moved in result["moved"]],
                "migration_bytes_intra": (np.asarray(result["moved_intra"]) * expert_bytes).tolist(),
                "migration_bytes_inter": (np.asarray(result["moved_inter"]) * expert_bytes).tolist()}

    def run(self) -> dict:
        """Train to train.steps from the newest checkpoint; the last step's metrics row. SIGTERM or
        Ctrl-C stops after the step in progress, checkpoints it and raises Interrupted."""
        t = self.config.train
        if self.is_main:
            run_folder.write_atomic(self.run_dir / "config.json", json.dumps(config_to_dict(self.config), indent=2))
        start = self._resume()
        bar = tqdm(range(start, t.steps), initial=start, total=t.steps, desc=f"train [{self.config.moe.planner}]",
                   disable=not self.is_main)
        last, watchdog = None, None
        with StopSignals() as signals:
            for step in bar:
                last = self._step(step)
                done = last["step"]
                if watchdog is None and jax.process_count() > 1:
                    watchdog = Watchdog(self.peer_timeout, lambda: (
                        f"no step finished for {self.peer_timeout:.0f} s after step {last['step']}: a process of "
                        f"this {jax.process_count()}-process run has died or hangs; last good checkpoint: "
                        f"{self._last_good()}")).start()
                if watchdog is not None:
                    watchdog.pet()
                if self.is_main and (done % t.log_every == 0 or "eval_loss" in last or done == t.steps):
                    records.append_row(self.run_dir / "metrics.jsonl", last)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                imb=f"{max(last['imbalance_before']):.2f}->{max(last['imbalance_after']):.2f}")
                for hook in self.hooks:
                    if done % hook.every == 0:
                        hook.fn(self, done, last)
                if done % t.checkpoint_every == 0 or done == t.steps or signals.received is not None:
                    self._save(done)
                if signals.received is not None:
                    self.checkpointer.close()
                    raise Interrupted(signals.received, done)
        if watchdog is not None:
            watchdog.stop()
        self.checkpointer.close()  # the last step always checkpoints and saves the trace
        if self.is_main and (self.run_dir / "metrics.jsonl").exists():
            buffer = io.BytesIO()
            write_report(self.run_dir, self.config.moe.planner, buffer)
            run_folder.write_atomic(self.run_dir / "report.png", buffer.getvalue())
        if jax.process_count() > 1:
            # Process 0 writes the report while the others would already wait in JAX's shutdown
            # barrier, whose own deadline aborts a process that comes late (a loaded host): all leave
            # the run together here, under this run's timeout.
            ocp_multihost.sync_global_processes("jtopoep: run finished", timeout=int(self.peer_timeout),
                                                processes=set(range(jax.process_count())))
        return last or {}
