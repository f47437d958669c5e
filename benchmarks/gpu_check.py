"""GPU-only checks in one go (< 4 minutes): python -m benchmarks.gpu_check --out DIR

1. the `ragged` transport (jax.lax.ragged_all_to_all) against the exact `dense` emulation: the MoE
   layer's output and gradients on a mesh of the GPUs present, every planner, flat and hierarchical;
   and the guest-weight fetch with copies kept from a previous micro-batch (values and gradients);
2. planner latency on the GPU (R = 32, E = 256, K = 2, jitted, median), beside the host eplb planner,
   and whether every loop of the compiled planners has a known trip count (else XLA:GPU reads its exit
   test on the host after every iteration: jtopoep.planners.rounds.run_rounds);
3. the grouped GEMM, forward and backward, in receive buffers of 1, 1.25 and 2 times the rows that
   arrived: `moe.gemm=tiled` (the loop over row tiles), `moe.gemm=pallas` (the Mosaic GPU kernels,
   on Hopper) and `moe.gemm=xla` (jax.lax.ragged_dot; whether XLA kept a ragged-dot or expanded it
   into dense dots per group, whose time follows groups x buffer rows), each against a float32
   product; and the whole layer with `tiled` and `pallas` against `xla`;
4. whether XLA:GPU schedules the guest-weight transfer around the home-slot GEMM (the overlap the
   cost model assumes): in the compiled layer's schedule, the home GEMMs between the transfer's
   async start and done; and, with the weights in slices (moe.guest_weight_chunks), whether each
   slice's guest GEMMs run while the next slice is still in transfer;
5. the dispatch benchmark with the `ragged` transport;
6. a short training run of the tiny model with the `ragged` transport.
Writes DIR/gpu_check.json and prints a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.kernels import kernel_count, trip_counts
from benchmarks.loads import synthetic_families
from benchmarks.planners import in_layer, latency, make
from jtopoep.config import MoEConfig
from jtopoep.dispatch import ExpertWeights, moe_dispatch
from jtopoep.gemm import resolve_weight_chunks
from jtopoep.plan import contiguous_placement
from jtopoep.planners import get_planner
from jtopoep.topology import Topology, make_mesh


def mesh_shape(count: int) -> tuple[int, int]:
    return (2, count // 2) if count >= 4 and count % 2 == 0 else (1, count)


SPEC = P(("node", "gpu"))


def layer_inputs(d: int = 64, f: int = 96, dtype=np.float32):
    """(topology, mesh, sharded layer inputs, experts) for a Zipf-routed layer on the GPUs present."""
    nodes, gpus = mesh_shape(len(jax.devices()))
    topology = Topology(num_nodes=nodes, gpus_per_node=gpus)
    ranks = topology.num_ranks
    mesh = make_mesh(topology)
    experts, top_k, tokens = 4 * ranks, 2, 37
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, experts + 1) ** 1.1
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=p / p.sum()) for _ in range(ranks * tokens)]).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(ranks * tokens, d)), dtype)
    gates = jnp.asarray(rng.uniform(size=(ranks * tokens, top_k)), dtype)
    w = [jnp.asarray(rng.normal(size=s) * 0.1, dtype) for s in [(experts, d, f), (experts, d, f), (experts, f, d)]]
    return topology, mesh, jax.device_put((x, ids, gates, *w), NamedSharding(mesh, SPEC)), experts


def dispatch_layer(planner, mesh, experts: int, backend: str, hierarchical: bool = False, gemm: str = "xla"):
    """The MoE layer's expert computation over the mesh: (x, ids, gates, w_gate, w_up, w_down) -> y."""
    placement = contiguous_placement(planner.topology.num_ranks, experts)

    def body(x, ids, gates, wg, wu, wd):
        chunks = resolve_weight_chunks(MoEConfig.guest_weight_chunks, gemm, wg.shape[-1])
        return moe_dispatch(x, ids, gates, ExpertWeights(wg, wu, wd), placement, planner, backend=backend,
                            hierarchical=hierarchical, weight_chunks=chunks, gemm=gemm)[0]

    return jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 6, out_specs=SPEC)


def check_ragged(out: dict) -> None:
    topology, mesh, args, experts = layer_inputs()
    results = []
    for name in ("none", "eplb", "topoep", "taot"):
        planner = get_planner(name, topology=topology, num_experts=experts, guest_slots=0 if name == "none" else 2)
        for hierarchical in (False, True):
            outs = {}
            for backend in ("ragged", "dense"):
                layer = dispatch_layer(planner, mesh, experts, backend, hierarchical)
                fn = jax.jit(jax.value_and_grad(lambda x, ids, g, *w: (layer(x, ids, g, *w) ** 2).sum(),
                                                argnums=(0, 2, 3, 4, 5)))
                outs[backend] = jax.device_get(fn(*args))
            err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                      for a, b in zip(jax.tree.leaves(outs["ragged"]), jax.tree.leaves(outs["dense"])))
            results.append({"planner": name, "hierarchical": hierarchical, "max_abs_diff": err, "ok": err <= 1e-4})
            print(f"ragged vs dense {name} hierarchical={hierarchical}: max |diff| {err:.2e}", flush=True)
    out["ragged_vs_dense"] = {"mesh": f"{topology.num_nodes}x{topology.gpus_per_node}", "rows": results,
                              "all_ok": all(r["ok"] for r in results)}


def check_layer_gemms(out: dict) -> None:
    """The whole MoE layer (topoep, 2 guest slots, ragged transport, bfloat16, D 128, F 256) with
    `moe.gemm=tiled` and, on Hopper, `moe.gemm=pallas` against `moe.gemm=xla`: output and gradients,
    relative to their largest entry."""
    from jtopoep.gemm_hopper import hopper_available

    topology, mesh, args, experts = layer_inputs(d=128, f=256, dtype=jnp.bfloat16)
    planner = get_planner("topoep", topology=topology, num_experts=experts, guest_slots=2)
    outs = {}
    for gemm in ("xla", "tiled", "pallas") if hopper_available() else ("xla", "tiled"):
        layer = dispatch_layer(planner, mesh, experts, "ragged", gemm=gemm)
        fn = jax.jit(jax.value_and_grad(lambda x, ids, g, *w: (layer(x, ids, g, *w).astype(jnp.float32) ** 2).sum(),
                                        argnums=(0, 2, 3, 4, 5)))
        outs[gemm] = [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.device_get(fn(*args)))]
    result = {}
    for gemm in outs.keys() - {"xla"}:
        rel = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(outs[gemm], outs["xla"]))
        result[gemm] = {"max_rel_diff_vs_xla": rel, "ok": rel <= 2e-2}
        print(f"{gemm} layer vs xla (bfloat16): max relative diff {rel:.2e}", flush=True)
    out["layer_gemms"] = result


def check_kept_copies(out: dict, backend: str = "ragged") -> None:
    """Guest weights with copies kept from a previous micro-batch (jtopoep.guests), `backend`
    against `dense`: the fetched weights and the weights' gradient (the custom VJP's transpose of a
    ragged all-to-all)."""
    from jtopoep.guests import GuestCopies, fetch_guest_weights, join_hidden, kept_slots

    topology, mesh, args, experts = layer_inputs()
    ranks, slots = topology.num_ranks, 2
    if ranks == 1:
        out["kept_copies"] = {"skipped": "needs 2 or more GPUs: on one rank every expert is at home, so no guest is kept"}
        print("kept copies: skipped (one GPU)", flush=True)
        return
    rng = np.random.default_rng(1)
    home = np.arange(experts) // (experts // ranks)
    guests = np.array([rng.choice(np.flatnonzero(home != d), slots, replace=False) for d in range(ranks)], np.int32)
    held = np.where(rng.uniform(size=guests.shape) < 0.5, guests, -1).astype(np.int32)[:, ::-1].copy()
    w = args[3:]
    copies = [np.asarray(x)[np.maximum(held.reshape(-1), 0)] for x in jax.device_get(w)]
    guests, held = jnp.asarray(guests), jnp.asarray(held)
    placement = contiguous_placement(ranks, experts)
    results = []
    for each in (backend, "dense"):
        def body(wg, wu, wd, cg, cu, cd, backend=each):
            me = jax.lax.axis_index("node") * topology.gpus_per_node + jax.lax.axis_index("gpu")
            previous = GuestCopies(held, ExpertWeights(cg, cu, cd))
            got = join_hidden(fetch_guest_weights(ExpertWeights(wg, wu, wd), guests, placement, me,
                                                  gpus_per_node=topology.gpus_per_node, backend=backend,
                                                  previous=previous,
                                                  chunks=resolve_weight_chunks(MoEConfig.guest_weight_chunks,
                                                                               "auto", wg.shape[-1])))
            return jax.lax.psum(sum((g ** 2).sum() for g in got), ("node", "gpu")), got

        fn = jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 6, out_specs=(P(), ExpertWeights(SPEC, SPEC, SPEC)))
        grad = jax.jit(jax.value_and_grad(lambda *a: fn(*a), argnums=(0, 1, 2), has_aux=True))
        results.append(jax.device_get(grad(*w, *copies)))
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])))
    out["kept_copies"] = {"backend": backend, "max_abs_diff_vs_dense": err, "ok": err <= 1e-5,
                          "kept": int(kept_slots(guests, held).sum())}
    print(f"kept copies, {backend} vs dense: max |diff| {err:.2e}", flush=True)


def check_migration(out: dict, backend: str = "ragged") -> None:
    """Home experts moved to a random placement by the ragged all-to-all (jtopoep.migration): bit
    for bit the permutation gather."""
    from jtopoep.migration import migrate, slot_permutation

    topology, mesh, args, experts = layer_inputs()
    rng = np.random.default_rng(2)
    old, new = (rng.permutation(experts).reshape(topology.num_ranks, -1).astype(np.int32) for _ in range(2))
    weight = args[3]
    moved = jax.jit(lambda w, o, n: migrate(w, o, n, mesh, topology, backend=backend))(weight, old, new)
    want = np.asarray(jax.device_get(weight))[np.asarray(slot_permutation(old, new))]
    same = bool(np.array_equal(np.asarray(jax.device_get(moved)), want))
    out["migration"] = {"backend": backend, "bitwise_equal": same, "ok": same}
    print(f"migration, {backend}: bitwise equal to the gather: {same}", flush=True)


def planner_latency(out: dict) -> None:
    """The planner benchmark's latency measurement (interleaved rounds of back-to-back batches, the
    same planners and expert shapes), on this machine's default device."""
    topology = Topology.preset("h800-4x8")
    counts = synthetic_families(32, 256, 4096, steps=1)["zipf-1.0"][0]
    # One executable per planner: the spread between compilations (planners.COMPILES) was seen on
    # XLA:CPU, and four compilations of each planner would spend minutes of the lent device's time.
    lat = latency(topology, counts, 0.0, rounds=40, compiles=1)
    out["planner_latency_us"] = {"device": jax.devices()[0].device_kind,
                                 **{k: v * 1e6 for k, v in lat["median_s"].items()},
                                 "eplb_host_over_topoep": lat["eplb_host_over_topoep"]}
    print("planner latency (us):", {k: round(v * 1e6) for k, v in lat["median_s"].items()}, flush=True)
    loops, kernels = {}, {}
    for name in ("none", "eplb", "topoep", "taot"):
        # The programs latency() timed, as this GPU compiled them: their kernels are what
        # benchmarks.kernels --target h100 fits its latency line to (kernel_count refuses a loop without
        # a known trip count, which the loops check below reports instead).
        hlo = jax.jit(in_layer(make(name, topology, 256, 2, 0.0))).lower(counts).compile().as_text()
        trips = trip_counts(hlo)
        if name in ("topoep", "taot"):
            loops[name] = {"loops": len(trips), "known_trip_count": sum(t is not None for t in trips)}
        if all(t is not None for t in trips):
            kernels[name] = kernel_count(hlo)
    out["planner_loops"] = loops
    out["planner_kernels"] = kernels
    print("planner loops (known trip count / all):", loops, "kernels:", kernels, flush=True)


def grouped_gemm(out: dict, d: int = 2048, f: int = 1408, rows: int = 4096 * 6, slots: int = 10) -> None:
    """Forward+backward of one SwiGLU-shaped grouped GEMM (DeepSeek-V2-Lite expert: D 2048, F 1408,
    bfloat16) over `slots` groups holding 24576 real rows (4096 tokens x top-6), in receive buffers of
    1, 1.25 and 2 times that many rows: `moe.gemm=tiled` (the loop over row tiles, jtopoep.gemm_tiled),
    `moe.gemm=pallas` (the Mosaic GPU kernels on Hopper) and `moe.gemm=xla` (jax.lax.ragged_dot as
    XLA:GPU compiles it; whether the compiled program kept a ragged-dot or dense dots), slowest last.
    Accuracy: each against a float32 product on random rows (output rows and both gradients, largest
    error over largest value), with large finite values in the rows past the groups (which must give
    zero output and zero gradient)."""
    import time

    from jtopoep.gemm import grouped_matmul
    from jtopoep.gemm_hopper import hopper_available

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(slots, d, f)) * 0.02, jnp.bfloat16)
    sizes = jnp.asarray(np.diff(np.linspace(0, rows, slots + 1).astype(int)), jnp.int32)
    gemms = ("tiled", "pallas", "xla") if hopper_available() else ("tiled", "xla")
    result = {"slots": slots, "rows": rows, "d": d, "f": f, "hopper_kernels": hopper_available()}

    def loss(x, w, cotangent, gemm):
        return (grouped_matmul(x, w, sizes, gemm).astype(jnp.float32) * cotangent).sum()

    # accuracy, buffer 1.25x the rows
    buffer = rows * 5 // 4
    x = rng.normal(size=(buffer, d)).astype(np.float32)
    x[rows:] = 1e4
    cotangent = jnp.asarray(rng.normal(size=(buffer, f)), jnp.float32)
    reference_rows = functools.partial(jax.lax.ragged_dot, group_sizes=sizes, precision=jax.lax.Precision.HIGHEST)
    reference = jax.jit(jax.grad(lambda x, w: (reference_rows(x, w) * cotangent).sum(), argnums=(0, 1)))
    x16 = jnp.asarray(x, jnp.bfloat16)
    ref_out = reference_rows(x16.astype(jnp.float32), w.astype(jnp.float32))[:rows]
    ref_dx, ref_dw = reference(x16.astype(jnp.float32), w.astype(jnp.float32))
    for gemm in gemms:
        try:
            fn = jax.jit(jax.value_and_grad(functools.partial(loss, cotangent=cotangent, gemm=gemm), argnums=(0, 1)))
            _, (dx, dw) = fn(x16, w)
            out_rows = grouped_matmul(x16, w, sizes, gemm)
            rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
            result[f"accuracy_{gemm}"] = {
                "out_rel": rel(out_rows[:rows], ref_out),
                "grad_x_rel": rel(dx[:rows], ref_dx[:rows]), "grad_w_rel": rel(dw, ref_dw),
                "rows_past_groups_zero": bool((out_rows[rows:] == 0).all() & (dx[rows:] == 0).all())}
        except Exception as err:  # record and go on to the timings
            result[f"accuracy_{gemm}"] = {"error": f"{type(err).__name__}: {err}"}
        print(f"grouped GEMM accuracy {gemm}: {result[f'accuracy_{gemm}']}", flush=True)

    for gemm in gemms:
        for factor in (1, 1.25, 2):
            key = f"{gemm}_buffer_x{factor:g}"
            try:
                x = jnp.zeros((int(rows * factor), d), jnp.bfloat16)
                cotangent = jnp.ones((int(rows * factor), f), jnp.float32)
                fn = jax.jit(jax.value_and_grad(functools.partial(loss, gemm=gemm), argnums=(0, 1)))
                hlo = fn.lower(x, w, cotangent).compile().as_text()
                jax.block_until_ready(fn(x, w, cotangent))
                start = time.perf_counter()
                for _ in range(5):
                    jax.block_until_ready(fn(x, w, cotangent))
                result[key] = {"ms": (time.perf_counter() - start) / 5 * 1e3, "ragged_dot_kept": "ragged-dot" in hlo}
            except Exception as err:
                result[key] = {"error": f"{type(err).__name__}: {err}"}
            print(f"grouped GEMM {gemm}, buffer {factor:g}x the rows: {result[key]}", flush=True)
    out["grouped_gemm"] = result


def _opcode(line: str) -> str | None:
    """The opcode of one HLO instruction line, after its result type (a tuple type has spaces)."""
    _, sep, rest = line.partition("=")
    rest = rest.lstrip()
    if not sep or not rest:
        return None
    if rest.startswith("("):  # skip the tuple type, parentheses balanced
        depth = 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        rest = rest[end + 1:]
    else:
        rest = rest.partition(" ")[2]
    opcode = rest.strip().partition("(")[0]
    return opcode if opcode.replace("-", "").isalnum() else None


def guest_overlap(out: dict, backend: str = "ragged", gemm: str = "auto") -> None:
    """Where the compiled forward layer (topoep, K = 2, moe.gemm `gemm`) schedules the guest-weight
    transfer against the home-slot GEMMs: the entry computation's instructions in schedule order,
    those named under the "guest_weights" scope that start or finish an asynchronous operation, and
    those of the "home_ffn" scope that are GEMMs (a dot, or the tiled SwiGLU's loop). The transfer
    hides behind the home GEMMs when they all lie between its start and its done."""
    import re

    topology, mesh, args, experts = layer_inputs()
    if topology.num_ranks == 1:
        out["guest_overlap"] = {"skipped": "needs 2 or more GPUs: on one rank no guest weight is transferred"}
        print("guest-weight overlap: skipped (one GPU)", flush=True)
        return
    planner = get_planner("topoep", topology=topology, num_experts=experts, guest_slots=2)
    hlo = jax.jit(dispatch_layer(planner, mesh, experts, backend, gemm=gemm)).lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    entry = entry[:next(i for i, line in enumerate(entry) if line.startswith("}")) + 1]
    starts, dones, gemms = [], [], []
    slice_starts, slice_dones, slice_gemms = {}, {}, {}  # slice -> schedule positions

    def is_gemm(op_name: str, line: str) -> bool:  # a dot, fused or a library call, or a tiled SwiGLU's loop
        return op_name.endswith("dot_general") or bool(
            re.search(r"(home_ffn|slice\d+)/while$", op_name) and _opcode(line) == "while")

    for i, line in enumerate(entry):
        name = re.search(r'op_name="([^"]*)"', line)
        opcode = _opcode(line)
        if not name or not opcode:
            continue
        piece = re.search(r"/slice(\d+)/", name.group(1))
        if "guest_weights" in name.group(1) and opcode.endswith("-start"):
            starts.append((i, opcode))
            if piece:
                slice_starts.setdefault(int(piece.group(1)), []).append(i)
        elif "guest_weights" in name.group(1) and opcode.endswith("-done"):
            dones.append((i, opcode))
            if piece:
                slice_dones.setdefault(int(piece.group(1)), []).append(i)
        elif "home_ffn" in name.group(1) and is_gemm(name.group(1), line):
            gemms.append((i, opcode))
        elif "guest_ffn" in name.group(1) and is_gemm(name.group(1), line) and piece:
            slice_gemms.setdefault(int(piece.group(1)), []).append(i)
    hidden = bool(starts and dones and gemms and min(i for i, _ in starts) < min(i for i, _ in gemms)
                  and max(i for i, _ in gemms) < max(i for i, _ in dones))
    # Slice c's guest GEMMs overlap slice c + 1's transfer when one of them lies between that
    # transfer's first start and last done.
    overlapped = {c: any(min(slice_starts[c + 1]) < i < max(slice_dones[c + 1]) for i in slice_gemms.get(c, []))
                  for c in sorted(slice_gemms) if c + 1 in slice_starts and c + 1 in slice_dones}
    out["guest_overlap"] = {"backend": backend, "gemm": gemm, "async_starts": starts, "async_dones": dones,
                            "home_gemms": gemms, "home_gemms_inside_transfer": hidden,
                            "slice_gemms": slice_gemms, "slice_gemms_inside_next_transfer": overlapped}
    print(f"guest-weight transfer around the home GEMMs: {len(starts)} async starts, {len(dones)} dones, "
          f"{len(gemms)} home GEMMs; all home GEMMs inside the transfer: {hidden}; guest slice GEMMs inside the "
          f"next slice's transfer: {overlapped}", flush=True)


# The whole-layer GEMM check is short and comes before the GEMM timings, which may run into the limit.
CHECKS = (check_ragged, check_kept_copies, check_migration, planner_latency, check_layer_gemms, grouped_gemm,
          guest_overlap)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", nargs="+", choices=[c.__name__ for c in CHECKS], help="run these checks alone")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"devices": [d.device_kind for d in jax.devices()], "backend": jax.default_backend(),
           "jax": jax.__version__}
    for step in CHECKS:
        if args.only and step.__name__ not in args.only:
            continue
        try:
            step(out)
        except Exception as err:  # record and go on: one failing check must not hide the others
            out[step.__name__ + "_error"] = f"{type(err).__name__}: {err}"
            print(f"{step.__name__} failed: {err}", flush=True)
        # after every check: a run stopped at its time limit keeps what it measured
        (args.out / "gpu_check.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
