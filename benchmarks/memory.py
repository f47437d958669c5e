"""Device memory of one MoE layer at a real model's shape, without running it:
python -m benchmarks.memory [--target cpu|h100] [--models deepseek-v3 qwen1.5-moe] [--topology h800-4x8]

Compiles the layer's forward and backward (jitted, sharded over the mesh, bfloat16 as the GPU presets
compute, the hierarchical dispatch that is the default on several nodes) for each model, planner,
grouped GEMM and receive-buffer size, and reads XLA's memory analysis per device: arguments, outputs
and temporaries. moe.recv_capacity_factor f gives every rank's receive buffer, and every relay's two
buffers, f x T x k rows. T = 4096 tokens per GPU. Experts are padded to a multiple of the ranks
(Qwen1.5-MoE: 60 -> 64) as a deployment would.

--target h100 (the default where JAX's CUDA plugin is installed: `pip install
"jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"`) compiles for H100
GPUs without one (benchmarks.gpu_target), with the `ragged` transport and moe.gemm xla and pallas
(the Mosaic GPU kernels; where expert_hidden / moe.guest_weight_chunks is not a multiple of 128, the
largest chunk count that is).
These are the buffers a GPU run allocates. Writes memory_h100.json and memory_h100.md.

--target cpu compiles for XLA:CPU, which cannot compile the `ragged` transport, so with the exact
`dense` emulation (each exchange pads what it sends every peer to the most one peer can receive) and
XLA:CPU's expansion of ragged_dot into a dense dot over every group: compare planners at one factor,
not with a GPU. Writes memory.json and memory.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib

from benchmarks import gpu_target

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FACTORS = (1.0, 1.25, 1.5)
PLANNERS = ("none", "topoep")
TOKENS = 4096


def _hopper_chunks(expert_hidden: int, chunks: int) -> int:
    """The largest chunk count at most `chunks` whose hidden slices fit the Hopper kernels' tiles."""
    from jtopoep.gemm import most_slices
    from jtopoep.gemm_hopper import TILE

    fits = most_slices(chunks, "pallas", expert_hidden)
    if not fits:
        raise ValueError(f"expert_hidden = {expert_hidden} is not a multiple of {TILE}: moe.gemm=pallas refuses it")
    return fits


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("cpu", "h100"), default=None,
                        help="h100 where JAX's CUDA plugin is installed, else cpu")
    parser.add_argument("--models", nargs="+", default=["deepseek-v3", "qwen1.5-moe"])
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS))
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    parser.add_argument("--gemms", nargs="+", choices=("xla", "tiled", "pallas"), default=None,
                        help="moe.gemm values to compile (default: xla, tiled and, on h100, pallas)")
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="moe.guest_weight_chunks values to compile (default: the config's default; `none` "
                             "fetches no guest weights and is compiled once)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    target = args.target or ("h100" if gpu_target.cuda_plugin_installed() else "cpu")
    if target == "h100" and not gpu_target.cuda_plugin_installed():
        parser.error(gpu_target.NEEDS_PLUGIN)
    import yaml

    from jtopoep import xla_cpu
    from jtopoep.config import CONFIG_DIR, ModelConfig, MoEConfig, TopologyConfig, section_from_dict
    from jtopoep.gemm import resolve_weight_chunks

    topo_cfg = section_from_dict("topology", TopologyConfig,
                                 yaml.safe_load((CONFIG_DIR / "topologies" / f"{args.topology}.yaml").read_text()))
    if target == "cpu":
        # The planners' settings, with XLA's default emitters: the fusions they make set the buffers.
        xla_cpu.configure(loop_emitters=False)
        xla_cpu.emulate_cpu_devices(topo_cfg.num_devices)

    import jax
    import jax.numpy as jnp

    from jtopoep.topology import make_mesh

    topology = topo_cfg.to_topology()
    if target == "h100":
        devices = gpu_target.described_gpus(topology.num_nodes, topology.gpus_per_node)
        on_target, transport, gemms = gpu_target.answering_as(devices), "ragged", ("xla", "tiled", "pallas")
    else:
        devices, on_target, transport, gemms = None, contextlib.nullcontext(), "dense", ("xla", "tiled")
    if args.gemms:
        if target == "cpu" and "pallas" in args.gemms:
            parser.error("--gemms pallas needs --target h100: on CPU it is megablox in interpret mode")
        gemms = tuple(args.gemms)
    mesh = make_mesh(topology, devices=devices)
    ranks = topology.num_ranks
    rows = []
    with on_target:
        for name in args.models:
            model = section_from_dict("model", ModelConfig,
                                      yaml.safe_load((CONFIG_DIR / "models" / f"{name}.yaml").read_text()))
            experts = -(-model.num_experts // ranks) * ranks
            dtype = jnp.dtype(model.dtype)
            x = jax.ShapeDtypeStruct((ranks, TOKENS, model.d_model), dtype, sharding=jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(("node", "gpu"))))
            for gemm in gemms:
                every = [_hopper_chunks(model.expert_hidden, c) if gemm == "pallas" and c
                         else resolve_weight_chunks(c, gemm, model.expert_hidden)
                         for c in args.chunks or [MoEConfig.guest_weight_chunks]]
                every = list(dict.fromkeys(every))
                for planner in args.planners:
                    for chunks in every[:1] if planner == "none" else every:
                        for factor in args.factors:
                            moe = MoEConfig(planner=planner, transport=transport, recv_capacity_factor=factor,
                                            gemm=gemm, guest_weight_chunks=chunks)
                            row = _measure(model, experts, dtype, moe, topology, mesh, x)
                            row.update(model=name, experts=experts, planner=planner, factor=factor, gemm=gemm,
                                       chunks=chunks, target=target)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    for row in rows:
        base = [r for r in rows if r["model"] == row["model"] and r["factor"] == row["factor"]
                and r["gemm"] == row["gemm"] and r["planner"] == "none"]
        row["temp_vs_none"] = row["temp_gb"] / base[0]["temp_gb"] if base else None
    _write(args.out, target, args.topology, rows)
    return rows


def _measure(model, experts, dtype, moe, topology, mesh, x) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jtopoep.layer import MoELayer

    layer = nnx.eval_shape(lambda: MoELayer(model.d_model, experts, model.top_k, model.expert_hidden, moe, topology,
                                            mesh, dtype=dtype, rngs=nnx.Rngs(0)))
    # Gradients of the parameters only, as the trainer takes them: the layer's other state (its
    # placement, load statistics) holds integers.
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, rest, x):
        y, stats = nnx.merge(graphdef, params, rest)(x)
        return (y.astype(jnp.float32) ** 2).mean() + stats["aux_loss"]

    memory = jax.jit(jax.value_and_grad(loss)).lower(params, rest, x).compile().memory_analysis()
    receive = layer.recv_rows(TOKENS)
    # The relay's stage-1 receive buffer (jtopoep.relay: at most N x T rows).
    relay = min(receive, topology.num_nodes * TOKENS) if topology.num_nodes > 1 else 0
    return {"receive_rows": receive,
            "buffers_gb": (receive + relay) * model.d_model * dtype.itemsize / 1e9,
            "bound_gb": 2 * TOKENS * model.top_k * model.d_model * dtype.itemsize / 1e9,
            "argument_gb": memory.argument_size_in_bytes / 1e9, "output_gb": memory.output_size_in_bytes / 1e9,
            "temp_gb": memory.temp_size_in_bytes / 1e9}


def _write(out: pathlib.Path, target: str, topology: str, rows: list[dict]) -> None:
    stem = "memory" if target == "cpu" else f"memory_{target}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"target": target, "topology": topology, "tokens": TOKENS,
                                                  "rows": rows}, indent=1))
    if target == "cpu":
        how = ("XLA:CPU with the dense exchange emulation; compare planners at one factor, not a GPU measurement. "
               "`python -m benchmarks.memory --target cpu`")
    else:
        how = ("XLA:GPU compiling for H100s without one (benchmarks/gpu_specs/h100_sxm.txtpb), ragged transport. "
               "`python -m benchmarks.memory --target h100`")
    lines = [f"One MoE layer on {topology}, {TOKENS} tokens per GPU, forward and backward, bfloat16, hierarchical "
             f"dispatch: XLA's memory analysis per device of the compiled program ({how})", "",
             "| model | planner | moe.gemm | moe.guest_weight_chunks | moe.recv_capacity_factor | receive rows | "
             "receive buffers GB | 2 T k D bytes GB | arguments GB | temporaries GB | temporaries / none's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        versus = "" if r["temp_vs_none"] is None else f"{r['temp_vs_none']:.2f}"
        lines.append(f"| {r['model']} (E {r['experts']}) | {r['planner']} | {r['gemm']} | {r['chunks']} | "
                     f"{r['factor']:g} | {r['receive_rows']:,} | {r['buffers_gb']:.2f} | {r['bound_gb']:.2f} | "
                     f"{r['argument_gb']:.2f} | {r['temp_gb']:.2f} | {versus} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
