"""Device memory of one MoE layer at a real model's shape, without running it:
python -m benchmarks.memory [--models deepseek-v3 qwen1.5-moe] [--topology h800-4x8]

Compiles the layer's forward and backward (jitted, sharded over the emulated mesh, bfloat16 as the
GPU presets compute, the hierarchical dispatch that is the default on several nodes) for each model,
planner and receive-buffer size, and reads XLA's memory analysis per device: arguments, outputs and
temporaries. moe.recv_capacity_factor f gives every rank's receive buffer, and every relay's two
buffers, f x T x k rows; 0 room for every pair of every source. T = 4096 tokens per GPU. Experts are
padded to a multiple of the ranks (Qwen1.5-MoE: 60 -> 64) as a deployment would.

Compiled for XLA:CPU, which cannot compile the `ragged` transport, so with the exact `dense`
emulation (each exchange pads what it sends every peer to the most one peer can receive) and XLA:CPU's
expansion of ragged_dot into a dense dot over every group: read the temporaries as what the buffers
drive, compared across planners at one factor, not as a GPU measurement. The receive-buffer column is
the ragged path's receive buffers (the rank's receive rows, and its stage-1 rows as a relay) x D x
bytes, beside the issue's bound of 2 x T x k x D x bytes.
Writes benchmarks/results/memory.json and memory.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FACTORS = (1.0, 1.25, 1.5)
PLANNERS = ("none", "topoep")
TOKENS = 4096


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["deepseek-v3", "qwen1.5-moe"])
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS))
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    import yaml

    from jtopoep import xla_cpu
    from jtopoep.config import CONFIG_DIR, ModelConfig, TopologyConfig, section_from_dict

    topo_cfg = section_from_dict("topology", TopologyConfig,
                                 yaml.safe_load((CONFIG_DIR / "topologies" / f"{args.topology}.yaml").read_text()))
    xla_cpu.configure()
    xla_cpu.emulate_cpu_devices(topo_cfg.num_devices)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jtopoep.config import MoEConfig
    from jtopoep.layer import MoELayer
    from jtopoep.topology import make_mesh

    topology = topo_cfg.to_topology()
    mesh = make_mesh(topology)
    ranks = topology.num_ranks
    rows = []
    for name in args.models:
        model = section_from_dict("model", ModelConfig,
                                  yaml.safe_load((CONFIG_DIR / "models" / f"{name}.yaml").read_text()))
        experts = -(-model.num_experts // ranks) * ranks
        dtype = jnp.dtype(model.dtype)
        x = jax.ShapeDtypeStruct((ranks, TOKENS, model.d_model), dtype,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("node", "gpu"))))
        for planner in args.planners:
            for factor in args.factors:
                moe = MoEConfig(planner=planner, transport="dense", recv_capacity_factor=factor)
                layer = nnx.eval_shape(lambda: MoELayer(model.d_model, experts, model.top_k, model.expert_hidden,
                                                        moe, topology, mesh, dtype=dtype, rngs=nnx.Rngs(0)))
                # Gradients of the parameters only, as the trainer takes them: the layer's other
                # state (its placement, load statistics) holds integers.
                graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

                def loss(params, rest, x):
                    y, stats = nnx.merge(graphdef, params, rest)(x)
                    return (y.astype(jnp.float32) ** 2).mean() + stats["aux_loss"]

                memory = jax.jit(jax.value_and_grad(loss)).lower(params, rest, x).compile().memory_analysis()
                receive = layer.recv_rows(TOKENS)
                # The relay's stage-1 receive buffer (jtopoep.relay: at most N x T rows).
                relay = min(receive, topology.num_nodes * TOKENS) if topology.num_nodes > 1 else 0
                row = {"model": name, "experts": experts, "planner": planner, "factor": factor, "receive_rows": receive,
                       "buffers_gb": (receive + relay) * model.d_model * dtype.itemsize / 1e9,
                       "bound_gb": 2 * TOKENS * model.top_k * model.d_model * dtype.itemsize / 1e9,
                       "argument_gb": memory.argument_size_in_bytes / 1e9, "output_gb": memory.output_size_in_bytes / 1e9,
                       "temp_gb": memory.temp_size_in_bytes / 1e9}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["factor"] == row["factor"]
                    and r["planner"] == "none") if "none" in args.planners else None
        row["temp_vs_none"] = row["temp_gb"] / base["temp_gb"] if base else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps({"topology": args.topology, "tokens": TOKENS, "rows": rows},
                                                     indent=1))
    lines = [f"One MoE layer on {args.topology}, {TOKENS} tokens per GPU, forward and backward, bfloat16, hierarchical "
             f"dispatch: XLA's memory analysis per device of the compiled program (XLA:CPU with the dense exchange "
             f"emulation; compare planners at one factor, not a GPU measurement). `python -m benchmarks.memory`", "",
             "| model | planner | moe.recv_capacity_factor | receive rows | receive buffers GB | 2 T k D bytes GB | "
             "arguments GB | temporaries GB | temporaries / none's |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        versus = "" if r["temp_vs_none"] is None else f"{r['temp_vs_none']:.2f}"
        lines.append(f"| {r['model']} (E {r['experts']}) | {r['planner']} | {r['factor']:g} | {r['receive_rows']:,} | "
                     f"{r['buffers_gb']:.2f} | {r['bound_gb']:.2f} | {r['argument_gb']:.2f} | {r['temp_gb']:.2f} | {versus} |")
    (args.out / "memory.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
