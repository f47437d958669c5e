"""Trainer: smoke, balancing leaves the maths unchanged, resume equals an uninterrupted run, trace."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jtopoep.config import TopologyConfig, config_from_dict
from jtopoep.traces import load_recorded
from train.data import ByteDataset
from train.loop import NonFiniteLossError, OverflowWarning, ReceiveCapacityError, Trainer


def tiny(tmp_path, name, planner="topoep", steps=4, moe=None, **train):
    raw = {
        "topology": {"preset": "cpu-2x4"},
        "model": {"vocab_size": 64, "seq_len": 12, "d_model": 16, "num_layers": 2, "num_heads": 2,
                  "num_experts": 16, "top_k": 2, "expert_hidden": 12, "dense_hidden": 24, "moe_every": 1},
        # The guest weights in one slice (configs/tiny_cpu.yaml says why): each slice is a fetch of its
        # own to compile. Slices: test_dispatch, test_guests, and through the trainer
        # test_kept_guest_copies_change_no_loss_or_gradient.
        # DeepSeek-V3's router (sigmoid scores, a balancing bias) in every run: one default program that
        # most tests share, compiled once for the run (tests/conftest.py's compilation cache).
        "moe": {"planner": planner, "guest_slots": 0 if planner == "none" else 2, "price_transfers": False,
                "hierarchical": True, "recv_capacity_factor": 0, "guest_weight_chunks": 1, "score_fn": "sigmoid",
                "bias_balancing": True, "bias_update_rate": 0.01, **(moe or {})},
        # No evaluation (its step is a compile of its own) but where a test asks for it.
        "train": {"steps": steps, "batch_size": 16, "warmup_steps": 1, "learning_rate": 1e-2, "log_every": 1,
                  "eval_every": 0, "eval_batches": 1, "checkpoint_every": 2,
                  "run_dir": str(tmp_path / name), **train},
        "data": {"source": "synthetic"},
    }
    return config_from_dict(raw)


class Stop(Exception):
    pass


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_train_runs_and_writes_outputs(devices, tmp_path):
    config = tiny(tmp_path, "smoke", eval_every=3)
    last = Trainer(config).run()
    run_dir = tmp_path / "smoke"
    assert np.isfinite(last["loss"]) and last["step"] == 4
    assert (run_dir / "report.png").stat().st_size > 10_000
    trace = load_recorded(run_dir / "counts.npz")
    assert trace.shape == (4, 2, 8, 16)
    # every (token, expert) pair of every layer is recorded: batch * seq_len * top_k per step
    assert (trace.sum((2, 3)) == 16 * 12 * 2).all()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # evaluated every eval_every steps and at the last step
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 4] and np.isfinite(last["eval_loss"])
    assert all(max(r["imbalance_after"]) <= max(r["imbalance_before"]) for r in rows)
    assert any(max(r["imbalance_after"]) < max(r["imbalance_before"]) for r in rows), "topoep never balanced"


def test_balancing_does_not_change_the_loss(devices, tmp_path):
    # The topoep run has the settings of the other tests' default runs, so they share its compiles.
    with_none = Trainer(tiny(tmp_path, "none", planner="none")).run()
    with_topoep = Trainer(tiny(tmp_path, "topoep", planner="topoep")).run()
    np.testing.assert_allclose(losses(tmp_path / "none"), losses(tmp_path / "topoep"), rtol=2e-5, atol=0)
    assert with_none["step"] == with_topoep["step"] == 4


def test_rehome_moves_weights_and_moments_bitwise(devices, tmp_path):
    """A re-placement moves every expert's weights and AdamW moments to its new slot bit for bit (a
    gather by the permutation), and the model computes the same loss."""
    from jtopoep.migration import slot_permutation

    trainer = Trainer(tiny(tmp_path, "move", moe={"replace_every": 2}))
    trainer._step(0)  # averages and moments from one step
    layers = trainer.model.moe_layer()  # the MoE layers' variables, stacked [layers, ...]
    before_model = jax.device_get(nnx.to_flat_state(nnx.state(trainer.model)))
    before_opt = jax.device_get(nnx.to_flat_state(nnx.state(trainer.optimizer)))
    old = np.asarray(layers.placement.get_value())
    batch = trainer._device_batch(0, "eval")
    loss_before = float(trainer.eval_step(trainer.model, batch)[0])
    moved = jax.device_get(trainer.rehome_step(trainer.model, trainer.optimizer))
    new = np.asarray(layers.placement.get_value())
    assert old.shape == new.shape == (2, 8, 2) and (old != new).any(axis=(1, 2)).all()
    assert moved["moved"].shape == (2, 16) and moved["moved"].any(axis=1).all()
    np.testing.assert_array_equal(moved["placement"], new)
    perms = [np.asarray(slot_permutation(a, b)) for a, b in zip(old, new)]
    after_model = dict(jax.device_get(nnx.to_flat_state(nnx.state(trainer.model))))
    after_opt = dict(jax.device_get(nnx.to_flat_state(nnx.state(trainer.optimizer))))
    checked = 0
    for before, after in ((before_model, after_model), (before_opt, after_opt)):
        for path, value in before:
            value, got = np.asarray(value.get_value()), np.asarray(after[path].get_value())
            name = path[-1]
            if name in ("w_gate", "w_up", "w_down"):
                for layer, perm in enumerate(perms):  # each layer by its own placement change
                    np.testing.assert_array_equal(got[layer], value[layer][perm])
                checked += 1
            elif name != "placement":
                np.testing.assert_array_equal(got, value)
    assert checked == 3 * 3  # weights, first and second moments, each stacked over the layers
    assert float(trainer.eval_step(trainer.model, batch)[0]) == pytest.approx(loss_before, rel=1e-6)


def test_resume_matches_uninterrupted_across_a_replacement(devices, tmp_path):
    """Re-placing every 2 steps gives the losses of a run without it up to float rounding; a run
    stopped after the re-placement's checkpoint resumes with its placement, the same losses as the
    uninterrupted run, and its trace's entries once each."""
    Trainer(tiny(tmp_path, "fixed")).run()
    Trainer(tiny(tmp_path, "moving", moe={"replace_every": 2})).run()
    np.testing.assert_allclose(losses(tmp_path / "moving"), losses(tmp_path / "fixed"), rtol=2e-5, atol=0)
    rows = [json.loads(line) for line in (tmp_path / "moving" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["moved_experts"] and len(rows[1]["migration_bytes_inter"]) == 2
    assert "moved_experts" not in rows[3]  # not at the last step
    with np.load(tmp_path / "moving" / "counts.npz") as trace:
        placement = trace["placement"]
    assert placement.shape == (4, 2, 8, 2) and (placement[2] != placement[1]).any()

    config = tiny(tmp_path, "killed", moe={"replace_every": 2})
    trainer = Trainer(config)

    def kill(_trainer, step, _row):
        if step == 3:  # after the step-2 checkpoint (which holds the re-placement), before the step-4 one
            raise Stop

    trainer.add_hook(kill)
    with pytest.raises(Stop):
        trainer.run()
    trainer.checkpointer.close()
    resumed = Trainer(config)
    assert resumed.checkpointer.latest_step() == 2
    resumed.run()
    assert losses(tmp_path / "killed") == pytest.approx(losses(tmp_path / "moving"), rel=1e-6, abs=0)
    assert load_recorded(tmp_path / "killed" / "counts.npz").shape[0] == 4
    with np.load(tmp_path / "killed" / "counts.npz") as trace:  # steps 1-2 from the file, 3 and 4 once each
        np.testing.assert_array_equal(trace["step"], [1, 2, 3, 4])
        np.testing.assert_array_equal(trace["placement"], placement)


def poison_step(trainer, at_call: int, change) -> None:
    """Make the trainer's `at_call`-th step return change(its summary): a failure injected on the
    host, so the test reuses the step already compiled for these settings."""
    step_fn = trainer.train_step
    calls = []

    def poisoned(model, optimizer, tokens):
        out = step_fn(model, optimizer, tokens)
        calls.append(1)
        return change(out) if len(calls) == at_call else out

    trainer.train_step = poisoned


def test_non_finite_loss_fails_fast(devices, tmp_path):
    trainer = Trainer(tiny(tmp_path, "nan"))
    poison_step(trainer, 3, lambda out: {**out, "loss": np.float32("nan")})
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at step 3; last good checkpoint: step 2"):
        trainer.run()
    trainer.checkpointer.close()
    assert Trainer(tiny(tmp_path, "nan")).checkpointer.latest_step() == 2


def test_receive_buffer_overflow_stops_the_run_when_asked(devices, tmp_path):
    """With moe.on_overflow: error, a step whose plan overflowed a receive buffer (jtopoep.dispatch
    counts the pairs cut; the dispatch tests cover that count) stops the run with an error naming the
    layer and the knob, before anything of that step is saved."""
    trainer = Trainer(tiny(tmp_path, "cap", moe={"on_overflow": "error"}))
    poison_step(trainer, 3, lambda out: {**out, "dropped_pairs": out["dropped_pairs"].at[0, 1].set(7)})
    with pytest.raises(ReceiveCapacityError, match=r"step 3: MoE layer 1 .*\(7 pairs did not fit; "
                                                   r"moe\.recv_capacity_factor = 0\.0\).*last good checkpoint: step 2"):
        trainer.run()
    trainer.checkpointer.close()
    assert Trainer(tiny(tmp_path, "cap", moe={"on_overflow": "error"})).checkpointer.latest_step() == 2


def test_dropped_pairs_are_logged_per_layer_and_warn_past_the_threshold(devices, tmp_path):
    """moe.on_overflow: drop (the default) trains on; metrics.jsonl has the pairs dropped per layer,
    and a step dropping more than train.overflow_warn_fraction of a layer's pairs warns, naming it."""
    trainer = Trainer(tiny(tmp_path, "drop", overflow_warn_fraction=0.01))
    pairs = 16 * 12 * 2  # batch x sequence x top_k: 1% is 3.84 pairs
    poison_step(trainer, 2, lambda out: {**out, "dropped_pairs": out["dropped_pairs"].at[0, 0].set(3)})
    poison_step(trainer, 3, lambda out: {**out, "dropped_pairs": out["dropped_pairs"].at[0, 1].set(7)})
    with pytest.warns(OverflowWarning, match=r"step 3: MoE layer 1 .*\(7 pairs did not fit.*1\.82% of its pairs") as seen:
        trainer.run()
    assert len(seen) == 1 and 7 / pairs > 0.01 > 3 / pairs
    rows = [json.loads(line) for line in (tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["dropped_pairs"] for r in rows] == [[0, 0], [3, 0], [0, 7], [0, 0]]
    assert all(len(r["scaleout_rows"]) == 2 for r in rows)
    assert not any("eval_loss" in r for r in rows)  # train.eval_every: 0, never evaluated


def cross_entropies(run_dir):
    return [json.loads(line)["ce"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_data_parallel_mesh_in_bfloat16(devices, tmp_path):
    """Two expert-parallel groups of 2 x 2 ranks side by side on the outer "data" axis, computing in
    bfloat16 (model.dtype) on float32 parameters. Same batches as one group of 2 x 4 in float32, so
    the same cross-entropies up to bfloat16 rounding (the load-balancing loss is per group, so the
    total loss differs slightly)."""
    config = tiny(tmp_path, "dp")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"),
                                 topology=TopologyConfig(num_nodes=2, gpus_per_node=2, data_parallel=2))
    trainer = Trainer(config)
    assert trainer.mesh.axis_names == ("data", "node", "gpu")
    last = trainer.run()
    assert np.isfinite(last["loss"])
    assert all(w.dtype == np.float32 for w in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
    trace = load_recorded(tmp_path / "dp" / "counts.npz")
    assert trace.shape == (4, 2, 4, 16)
    # each expert-parallel group routes its own half of the batch: 8 sequences x 12 tokens x top-2
    assert (trace.sum((2, 3)) == 8 * 12 * 2).all()
    Trainer(tiny(tmp_path, "f32")).run()  # the default run: compiled already by the tests above
    assert cross_entropies(tmp_path / "dp") == pytest.approx(cross_entropies(tmp_path / "f32"), rel=2e-2)


def test_model_is_created_on_its_shards(devices, tmp_path):
    """Expert weights come out of initialisation split over ("node", "gpu") (each device holds E / R
    experts, the same on both data-parallel replicas), the rest replicated, with the values an eager
    construction gives up to float32 rounding of the fused initialiser."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jtopoep.layer import ExpertParam
    from jtopoep.topology import EP_AXES, make_mesh
    from models.moe_transformer import MoETransformer
    from train.loop import create_sharded_model

    config = dataclasses.replace(tiny(tmp_path, "init"),
                                 topology=TopologyConfig(num_nodes=2, gpus_per_node=2, data_parallel=2))
    topology = config.topology.to_topology()
    mesh = make_mesh(topology, data=2)
    model = create_sharded_model(config, topology, mesh)
    eager = MoETransformer(config.model, config.moe, topology, mesh, rngs=nnx.Rngs(config.train.seed))
    experts = jax.tree.leaves(nnx.state(model, ExpertParam))
    assert len(experts) == 3  # gate, up, down, each stacked over the MoE layers
    for w in experts:
        assert w.sharding.spec == P(None, EP_AXES) and w.shape[:2] == (config.model.num_moe_layers, 16)
        shards = w.addressable_shards
        assert len(shards) == 8 and all(s.data.shape[:2] == (2, 16 // 4) for s in shards)
        assert len({s.index[1].start for s in shards}) == 4  # each slice of experts on both replicas
    for w in jax.tree.leaves(nnx.state(model, nnx.Not(ExpertParam))):
        assert w.sharding.is_fully_replicated
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(eager))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_two_processes_train_like_one(devices, tmp_path):
    """A multi-host run: `python -m train` in two processes of four CPU devices each (one node of the
    2 x 4 mesh apiece, collectives over Gloo), against the same run in this one process. Same
    losses, the log and trace written once, by process 0."""
    import subprocess
    import sys

    import yaml
    from conftest import child_env, free_port

    from jtopoep.config import config_to_dict

    # eplb: its guest copies are fetched across the two processes too, and its step compiles faster
    # than topoep's (three compiles here: each child's and this process's).
    config = tiny(tmp_path, "two", planner="eplb")
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
    port = free_port()
    env = child_env()  # each child emulates its own 4 devices
    children = [subprocess.Popen([sys.executable, "-m", "train", "--config", str(tmp_path / "two.yaml"),
                                  "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id",
                                  str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(2)]
    outputs = [child.communicate(timeout=600)[0] for child in children]
    # Both outputs on failure: the process that fails first may be the one waiting on the other.
    assert [child.returncode for child in children] == [0, 0], "\n".join(
        f"process {i} (status {child.returncode}):\n{out[-3000:]}"
        for i, (child, out) in enumerate(zip(children, outputs)))
    Trainer(tiny(tmp_path, "one", planner="eplb")).run()
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=0)
    two, one = load_recorded(tmp_path / "two" / "counts.npz"), load_recorded(tmp_path / "one" / "counts.npz")
    assert two.shape == one.shape == (4, 2, 8, 16)
    np.testing.assert_array_equal(two[0], one[0])
    assert (tmp_path / "two" / "checkpoints").is_dir() and (tmp_path / "two" / "report.png").exists()


def test_micro_batches_are_routed_apart_and_make_one_step(devices, tmp_path):
    """train.microbatches = 2: each half of the batch is routed, planned and dispatched on its own (the
    trace has an entry per micro-batch, and the experts' loads add up to the whole batch's), and the
    first step's cross-entropy, taken before any update, is the whole batch's."""
    # Planner `none` (how a micro-batch is planned is the dispatch tests' concern): its whole-batch run is
    # compiled already by test_balancing_does_not_change_the_loss, and its step compiles fastest.
    Trainer(tiny(tmp_path, "whole", planner="none")).run()
    last = Trainer(tiny(tmp_path, "halves", planner="none", microbatches=2)).run()
    assert last["step"] == 4 and np.isfinite(last["loss"])
    whole = load_recorded(tmp_path / "whole" / "counts.npz")
    halves = load_recorded(tmp_path / "halves" / "counts.npz")
    assert halves.shape == (8, 2, 8, 16)
    with np.load(tmp_path / "halves" / "counts.npz") as trace:
        np.testing.assert_array_equal(trace["step"], [1, 1, 2, 2, 3, 3, 4, 4])
    assert (halves.sum((2, 3)) == 8 * 12 * 2).all()  # 8 of the 16 sequences each
    # Each rank holds other sequences in each half than in the whole batch; each expert's total is the same.
    np.testing.assert_array_equal(halves[0].sum(1) + halves[1].sum(1), whole[0].sum(1))
    assert cross_entropies(tmp_path / "halves")[0] == pytest.approx(cross_entropies(tmp_path / "whole")[0], rel=1e-6)


def test_accumulated_gradient_is_the_whole_batch_gradient(devices, tmp_path):
    """Without the load-balancing loss (a product of batch means, so not a mean over micro-batches) the
    loss is a mean over tokens, and the mean of two halves' gradients is the whole batch's."""
    from jtopoep.topology import make_mesh
    from train.loop import accumulated_grads, create_sharded_model

    config = tiny(tmp_path, "grads", planner="none", moe={"aux_loss_coef": 0.0})
    topology = config.topology.to_topology()
    mesh = make_mesh(topology)
    model = create_sharded_model(config, topology, mesh)
    batch = ByteDataset(config.data, config.model.seq_len, config.model.vocab_size, 0).batch(0, 16)
    step = nnx.jit(lambda m, t: accumulated_grads(m, t, config.moe))
    sharding = NamedSharding(mesh, P(None, mesh.axis_names))
    loss_1, ce_1, _, grads_1 = step(model, jax.device_put(batch[None], sharding))
    loss_2, ce_2, stats_2, grads_2 = step(model, jax.device_put(batch.reshape(2, 8, -1), sharding))
    assert stats_2["counts"].shape == (2, 2, 8, 16)  # [micro-batches, layers, R, E]
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-6)
    np.testing.assert_allclose(ce_2, ce_1, rtol=1e-6)
    leaves_1, leaves_2 = jax.tree.leaves(grads_1), jax.tree.leaves(grads_2)
    assert len(leaves_1) == len(leaves_2) > 0
    for a, b in zip(leaves_1, leaves_2):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_scanned_and_rematerialised_layers_compute_what_the_unrolled_loop_does(devices, tmp_path):
    """model.scan_layers (jax.lax.scan over the stacked MoE units; here a dense block before them,
    each unit an MoE block and a dense one) and model.remat (attention, full) give the loss, stats and
    gradients of a Python loop over the same weights keeping every activation, up to float rounding."""
    from jtopoep.topology import make_mesh
    from models.moe_transformer import Block
    from train.loop import accumulated_grads, create_sharded_model

    # eplb: its copies take the guest-slot path through the scan, and its step compiles faster than
    # topoep's (which planner fills the slots is the planner tests' concern).
    config = tiny(tmp_path, "scan", planner="eplb")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=5, first_dense_layers=1,
                                                                     moe_every=2))
    topology = config.topology.to_topology()
    mesh = make_mesh(topology)
    model = create_sharded_model(config, topology, mesh)
    assert model.moe_layer().w_gate.get_value().shape == (2, 16, 16, 12)
    batch = ByteDataset(config.data, config.model.seq_len, config.model.vocab_size, 0).batch(0, 16)
    tokens = jax.device_put(batch[None], NamedSharding(mesh, P(None, mesh.axis_names)))
    blocks = [node for _, node in nnx.iter_graph(model) if isinstance(node, Block)]
    assert len(blocks) == 3  # the dense first block, and the unit's two (stacked)

    def run(scan, remat):  # the same weights, run as the settings would build the model
        model.scan_layers, model.remat_layers = scan, remat == "full"
        for block in blocks:
            block.remat_attention = remat == "attention"
        return jax.device_get(nnx.jit(lambda m, t: accumulated_grads(m, t, config.moe))(model, tokens))

    looped = run(False, "none")
    assert looped[2]["counts"].shape == (1, 2, 8, 16)  # [micro-batches, MoE layers, R, E]
    # A scan without remat is the attention-remat scan without its jax.checkpoint: the two cases
    # below cover it (each compile of this model takes a fifth of the test).
    for scan, remat in ((True, "attention"), (True, "full")):
        got = run(scan, remat)
        for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7, err_msg=f"{scan} {remat}")


def test_kept_guest_copies_change_no_loss_or_gradient(devices, tmp_path):
    """moe.keep_copies: a guest copy a rank holds again in the step's second micro-batch is taken
    from the first instead of fetched, and changes no loss or gradient (bitwise for the same plan:
    test_guests; the planner may put a copy on another rank that balances as well, which changes float
    rounding only, as any plan does). On two expert-parallel groups side by side ("data" axis), each
    keeping the copies of its own plans."""
    from train.loop import accumulated_grads

    results = {}
    for keep in (True, False):
        # eplb: the same guest-slot paths, and its step compiles faster than topoep's.
        config = tiny(tmp_path, f"keep_{keep}", planner="eplb", moe={"keep_copies": keep, "guest_weight_chunks": 2},
                      microbatches=2)
        # One layer (an MoE layer) keeps the compiles of the two scans short.
        config = dataclasses.replace(config, topology=TopologyConfig(num_nodes=2, gpus_per_node=2, data_parallel=2),
                                     model=dataclasses.replace(config.model, num_layers=1))
        trainer = Trainer(config)
        step = nnx.jit(lambda m, t, moe=config.moe: accumulated_grads(m, t, moe))
        # A batch whose two micro-batches copy some expert onto the same rank (not every batch does).
        results[keep] = jax.device_get(step(trainer.model, trainer._device_batch(1)))
    (loss, ce, stats, grads), (loss_f, ce_f, stats_f, grads_f) = results[True], results[False]
    kept = np.asarray(stats["kept_copies"]).T  # [layers, micro-batches]
    made = np.asarray(stats["guest_copies"]).T
    assert (kept[:, 0] == 0).all() and kept[:, 1].sum() > 0 and (kept <= made).all()
    assert (np.asarray(stats_f["kept_copies"]) == 0).all()
    np.testing.assert_allclose(loss, loss_f, rtol=2e-5)
    np.testing.assert_allclose(ce, ce_f, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_f), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
