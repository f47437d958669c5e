"""Device memory of one MoE layer at a real model's shape, without running it:
python -m benchmarks.memory [--model deepseek-v2-lite] [--topology h800-4x8]

Compiles the layer's forward and backward (jitted, sharded over the emulated mesh, bfloat16 as the
GPU presets compute) for each receive-buffer size and reads XLA's memory analysis per device:
arguments, outputs and temporaries. The receive buffer is what moe.recv_capacity_factor sizes: 0
gives each rank room for every pair of every source (R x T x k rows), a factor f gives f x T x k.
One sequence of the model's length per GPU. Compiled for XLA:CPU, which cannot compile the `ragged`
transport, so with the exact `dense` emulation (a padded all-to-all): its buffers are larger than the
ragged exchange's, and XLA:GPU assigns buffers differently, so read the figures as the size of what
the receive buffer drives (the exchange and the grouped GEMM over every row), not a GPU measurement. Writes benchmarks/results/memory.json and memory.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FACTORS = (0.0, 1.5)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS))
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    import yaml

    from jtopoep import xla_cpu
    from jtopoep.config import CONFIG_DIR, ModelConfig, TopologyConfig, section_from_dict

    model = section_from_dict("model", ModelConfig,
                              yaml.safe_load((CONFIG_DIR / "models" / f"{args.model}.yaml").read_text()))
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
    dtype = jnp.dtype(model.dtype)
    tokens = model.seq_len  # one sequence per GPU
    x = jax.ShapeDtypeStruct((topology.num_ranks, model.seq_len, model.d_model), dtype,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("node", "gpu"))))
    rows = []
    for factor in args.factors:
        moe = MoEConfig(planner="topoep", transport="dense", recv_capacity_factor=factor, hierarchical=True)
        layer = nnx.eval_shape(lambda: MoELayer(model.d_model, model.num_experts, model.top_k, model.expert_hidden,
                                                moe, topology, mesh, dtype=dtype, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(layer)

        def loss(state, x):
            y, stats = nnx.merge(graphdef, state)(x)
            return (y.astype(jnp.float32) ** 2).mean() + stats["aux_loss"]

        compiled = jax.jit(jax.value_and_grad(loss)).lower(state, x).compile()
        memory = compiled.memory_analysis()
        row = {"factor": factor, "receive_rows": (topology.num_ranks if factor == 0 else factor) * tokens * model.top_k,
               "argument_gb": memory.argument_size_in_bytes / 1e9, "output_gb": memory.output_size_in_bytes / 1e9,
               "temp_gb": memory.temp_size_in_bytes / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps({"model": args.model, "topology": args.topology, "rows": rows},
                                                     indent=1))
    lines = [f"One MoE layer of {args.model} (D {model.d_model}, F {model.expert_hidden}, E {model.num_experts}, "
             f"top-{model.top_k}, {model.dtype}) on {args.topology}, one {tokens}-token sequence per GPU, forward and "
             f"backward, topoep, hierarchical exchange: XLA's memory analysis per device of the compiled program "
             f"(XLA:CPU with the dense exchange emulation; the buffers, not a GPU measurement).", "",
             "| moe.recv_capacity_factor | receive rows per rank | arguments GB | outputs GB | temporaries GB |",
             "|---|---|---|---|---|"]
    for row in rows:
        name = "0 (room for every pair)" if row["factor"] == 0 else f"{row['factor']:g}"
        lines.append(f"| {name} | {row['receive_rows']:,.0f} | {row['argument_gb']:.2f} | {row['output_gb']:.2f} | "
                     f"{row['temp_gb']:.2f} |")
    (args.out / "memory.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
