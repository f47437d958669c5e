"""Compile and step time of one MoE layer's forward+backward per planner: python -m benchmarks.dispatch

Runs on whatever devices the process has: on CPU, 8 emulated devices (2 nodes x 4) and the exact
`dense` transport; on a GPU machine the `ragged` transport over the GPUs it has. Times are reported
as ratios to the `none` planner measured in the same run (wall-clock on emulated CPU devices says
nothing about GPU balance: the point here is the overhead of planning and rerouting, not speed-ups).
Guest weights come in the layer's default slices (moe.guest_weight_chunks).
Each setting runs with room for every pair in the receive buffers (recv_capacity_factor 0, R x T x k
rows) and with buffers of twice a rank's own pairs (factor 2; the grouped GEMM runs over the whole
buffer), recording the pairs a buffer could not take.
Writes benchmarks/results/dispatch_<backend>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--backend", default="auto", choices=("auto", "ragged", "dense"))
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--recv-capacity-factors", type=float, nargs="+", default=[0.0, 2.0],
                        help="receive buffers in multiples of a rank's own pairs; 0: room for every pair")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    ranks = args.nodes * args.gpus
    from jtopoep import xla_cpu

    xla_cpu.configure()  # as the trainer does
    xla_cpu.emulate_cpu_devices(ranks)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jtopoep.config import MoEConfig
    from jtopoep.dispatch import ExpertWeights, moe_dispatch, receive_rows
    from jtopoep.gemm import resolve_weight_chunks
    from jtopoep.plan import contiguous_placement
    from jtopoep.planners import get_planner
    from jtopoep.topology import Topology, make_mesh
    from jtopoep.transport import resolve_backend

    backend = resolve_backend(args.backend)
    topology = Topology(num_nodes=args.nodes, gpus_per_node=args.gpus)
    mesh = make_mesh(topology)
    experts, top_k, d_model, hidden = 4 * ranks, 4, 128, 256
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, experts + 1) ** 1.2  # Zipf-skewed routing, hot experts on the first ranks
    tokens = ranks * args.tokens
    ids = np.stack([rng.choice(experts, top_k, replace=False, p=p / p.sum()) for _ in range(tokens)]).astype(np.int32)
    x = rng.normal(size=(tokens, d_model)).astype(np.float32)
    gates = rng.uniform(size=(tokens, top_k)).astype(np.float32)
    w = [rng.normal(size=s).astype(np.float32) * 0.05
         for s in [(experts, d_model, hidden), (experts, d_model, hidden), (experts, hidden, d_model)]]
    spec = P(("node", "gpu"))
    args_dev = jax.device_put((x, ids, gates, *w), NamedSharding(mesh, spec))
    placement = contiguous_placement(ranks, experts)
    rows = {}
    settings = [(f, h, n) for f in args.recv_capacity_factors for h in (False, True)
                for n in ("none", "eplb", "topoep", "taot")]
    for factor, hierarchical, name in settings:
        planner = get_planner(name, topology=topology, num_experts=experts, guest_slots=0 if name == "none" else 2)
        recv_rows = receive_rows(factor, args.tokens * top_k, ranks)

        def body(x, ids, gates, wg, wu, wd, planner=planner, hierarchical=hierarchical, recv_rows=recv_rows):
            y, stats = moe_dispatch(x, ids, gates, ExpertWeights(wg, wu, wd), placement, planner, backend=backend,
                                    hierarchical=hierarchical, recv_rows=recv_rows,
                                    weight_chunks=resolve_weight_chunks(MoEConfig.guest_weight_chunks, "auto",
                                                                        wg.shape[-1]))
            return y, stats.dropped[None]

        layer = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))
        dropped = int(jax.jit(layer)(*args_dev)[1][0])
        step = jax.jit(jax.grad(lambda x, ids, g, *w: (layer(x, ids, g, *w)[0] ** 2).sum(), argnums=(0, 3, 4, 5)))
        start = time.perf_counter()
        compiled = step.lower(*args_dev).compile()
        compile_s = time.perf_counter() - start
        jax.block_until_ready(compiled(*args_dev))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args_dev))
            times.append(time.perf_counter() - start)
        rows[(factor, hierarchical, name)] = {"compile_s": compile_s, "step_s": statistics.median(times),
                                              "recv_rows": recv_rows,
                                              "dropped_pairs": dropped}
        print(f"recv factor {factor} hierarchical={hierarchical} {name}: compile {compile_s:.1f} s, "
              f"step {1e3 * statistics.median(times):.1f} ms, dropped {dropped}", flush=True)
    table = []
    for (factor, hierarchical, name), r in rows.items():
        # Ratios to `none` with room for every pair (the first factor), same hierarchy.
        base = rows[(args.recv_capacity_factors[0], hierarchical, "none")]
        table.append({"recv_capacity_factor": factor, "hierarchical": hierarchical, "planner": name, **r,
                      "compile_vs_none": r["compile_s"] / base["compile_s"], "step_vs_none": r["step_s"] / base["step_s"]})
    result = {"backend": backend, "device": jax.devices()[0].device_kind, "mesh": f"{args.nodes}x{args.gpus}",
              "tokens_per_rank": args.tokens, "experts": experts, "top_k": top_k, "d_model": d_model,
              "expert_hidden": hidden, "rows": table}
    lines = [f"Forward+backward of one MoE layer, {result['mesh']} mesh on {result['device']}, `{backend}` transport, "
             f"{args.tokens} tokens/rank, E = {experts}, k = {top_k}, D = {d_model}, F = {hidden}; ratios to `none` with "
             f"room for every pair (recv factor {args.recv_capacity_factors[0]:g}), in the same run. Receive buffer rows per "
             "rank: factor x T x k, or R x T x k for factor 0; the grouped GEMM runs over all of them.",
             "", "| recv factor | buffer rows | hierarchical | planner | pairs cut | compile s | compile vs none | step ms | "
             "step vs none |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['recv_capacity_factor']:g} | {r['recv_rows']} | {r['hierarchical']} | {r['planner']} | "
              f"{r['dropped_pairs']} | {r['compile_s']:.1f} | {r['compile_vs_none']:.2f} | {1e3 * r['step_s']:.1f} | "
              f"{r['step_vs_none']:.2f} |" for r in table]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dispatch_{backend}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"dispatch_{backend}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
