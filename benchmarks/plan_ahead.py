"""Can planning leave the critical path? Copies placed from the previous micro-batch's loads, against
copies planned on the loads being routed: python -m benchmarks.plan_ahead

On a GPU the planners run launch-bound, a few hundred small kernels between a layer's routing counts
and its dispatch (benchmarks.kernels --target h100). A plan made from the previous micro-batch's
counts of the same layer could be computed earlier, beside that micro-batch's token exchange, leaving
on the critical path only the refit of its quotas to the counts now routed. This measures what that
costs in balance and traffic, on the cluster projection's real routing (benchmarks.cluster: 4 x 8
H800 GPUs, K = 2, each model's deployment), per step:

- `now`: topoep on the counts being routed (the layer as it is), with the planning the projection
  charges it inside the step (kernels_h100.json);
- `ahead`: topoep's guest copies from the previous micro-batch of the layer (the first takes the
  last's), their quotas refitted to the counts now routed (`refit_quotas`: the spill above the
  target moves to the copies with room, first come first served, in `REFIT_ROUNDS` rounds); its
  planning charged nothing, in its favour;
- `none`: home experts only.

Terms from jtopoep.costmodel.layer_time (MoE GEMM, token exchange, guest weights). Projections, not
GPU measurements. Writes benchmarks/results/plan_ahead.json and plan_ahead.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from benchmarks.cluster import (MODELS, RESULTS, Deployment, deployment_latency, load_model, model_traces,
                                planning_latency)
from jtopoep import xla_cpu
from jtopoep.costmodel import layer_time
from jtopoep.planners import get_planner
from jtopoep.planners.arrays import prefix_sum
from jtopoep.planners.problem import CopyProblem
from jtopoep.planners.rounds import Copies, place, share_out
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.topology import Topology

SLOTS = 2
REFIT_ROUNDS = 2
TERMS = ("gemm_s", "exchange_s", "weights_s", "planning_s")


def refit_quotas(counts: Int[Array, "R E"], placement: Int[Array, "R H"], guests: Int[Array, "R K"],
                 gpus_per_node: int, rounds: int = REFIT_ROUNDS) -> tuple[Int[Array, "R S"], Int[Array, "R S"]]:
    """(slot_expert, quota) for fixed guest copies: in each round, every guest slot asks for its
    expert's spill above the balance target, up to its rank's room (the rank's slots in order), and
    the spill is shared out first come first served; each expert's home slot keeps the rest."""
    slots = guests.shape[1]
    problem = CopyProblem.build(counts, placement, gpus_per_node, slots)
    copies = Copies.start(problem, slots, gpus_per_node)._replace(guests=guests)
    for _ in range(rounds):
        spill, room = copies.spill(problem, placement), copies.room(problem, placement)
        want = jnp.where(guests >= 0, spill[jnp.maximum(guests, 0)], 0)
        want = jnp.clip(room[:, None] - (prefix_sum(want, 1) - want), 0, want)
        taken = share_out(guests.reshape(-1), want.reshape(-1), spill).reshape(guests.shape)
        # Each proposal adds to the copy its rank holds already (rounds.place, unpriced).
        copies = place(copies, guests, taken, problem, placement, None, None, gpus_per_node)
    return (jnp.concatenate([placement, guests], 1),
            jnp.concatenate([copies.kept[placement], copies.quotas], 1))


def study(model: str, topology: Topology, microbatches: int, latency: dict) -> dict:
    """Per-step terms of `none`, `now` and `ahead` on the model's micro-batches."""
    dep = Deployment(load_model(model), topology.num_ranks)
    placement = np.arange(dep.num_experts).reshape(topology.num_ranks, -1)
    planner = jax.jit(get_planner("topoep", topology=topology, num_experts=dep.num_experts, guest_slots=SLOTS,
                                  dims=dep.dims))
    refit = jax.jit(refit_quotas, static_argnums=3)
    home = jax.jit(get_planner("none", topology=topology, num_experts=dep.num_experts, guest_slots=0))
    planning_s = deployment_latency(latency, model, topology.num_ranks, SLOTS)["topoep"]
    mats = model_traces(model, topology.num_ranks, microbatches, None)
    totals = {name: dict.fromkeys(TERMS, 0.0) for name in ("none", "now", "ahead")}

    def add(name, plan, planning):
        terms = layer_time(jax.device_get(plan), topology, dep.dims, placement, planning)
        for key in TERMS:
            totals[name][key] += terms[key] / microbatches

    for layer in range(mats.shape[1]):
        counts = [dep.expand(mats[m, layer]) for m in range(microbatches)]
        plans = [planner(c, placement) for c in counts]
        for m, c in enumerate(counts):
            guests = plans[m - 1].slot_expert[:, placement.shape[1]:]  # the previous micro-batch's copies
            slot_expert, quota = refit(jnp.asarray(c), jnp.asarray(placement), guests, topology.gpus_per_node)
            add("ahead", plan_from_quotas(jnp.asarray(c), slot_expert, quota, topology.gpus_per_node, True), 0.0)
            add("now", plans[m], planning_s)
            add("none", home(c, placement), 0.0)
    return {name: {**terms, "moe_s": sum(terms.values())} for name, terms in totals.items()}


def markdown(results: dict) -> str:
    lines = [f"Copies from the previous micro-batch (`ahead`, planning charged nothing) against copies planned on the "
             f"counts being routed (`now`, planning at its in-step GPU charge), topoep, K = {SLOTS}, "
             f"{results['topology']}, {results['microbatches']} micro-batches of real routing per model "
             "(benchmarks.cluster's traces). Per step, ms; projections from jtopoep.costmodel. "
             "`python -m benchmarks.plan_ahead`", "",
             "| model | plan | MoE GEMM | exchange | weights | planning | MoE total | vs now |", "|---|---|---|---|---|---|---|---|"]
    for model, rows in results["models"].items():
        for name, row in rows.items():
            ratio = row["moe_s"] / rows["now"]["moe_s"] - 1
            lines.append(f"| {model} | {name} | " + " | ".join(f"{row[k] * 1e3:.1f}" for k in TERMS)
                         + f" | {row['moe_s'] * 1e3:.1f} | {ratio:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--model", action="append", choices=MODELS, help="repeatable; default: all presets")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.microbatches < 2:
        parser.error(f"--microbatches = {args.microbatches}: the copies come from another micro-batch, give at least 2")
    xla_cpu.configure()
    topology = Topology.preset(args.topology)
    latency = planning_latency(RESULTS / "planners.json", RESULTS / "kernels_h100.json")
    results = {"topology": args.topology, "microbatches": args.microbatches, "refit_rounds": REFIT_ROUNDS,
               "models": {}}
    for model in args.model or MODELS:
        results["models"][model] = study(model, topology, args.microbatches, latency)
        print(model, {k: round(v["moe_s"] * 1e3, 1) for k, v in results["models"][model].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_ahead.json").write_text(json.dumps(results, indent=1))
    (args.out / "plan_ahead.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
