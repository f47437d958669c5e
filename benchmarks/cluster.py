"""Projected cluster throughput of each planner on real routing: python -m benchmarks.cluster

For each model preset and planner, every MoE layer of a micro-batch is planned on counts from real
routing traces (mapped onto the preset's experts and the mesh), and its forward+backward time is
projected with jtopoep.costmodel; the non-MoE part of the step comes from the model's dimensions.
These are projections from a cost model, not GPU measurements.

Planners: none, eplb (per micro-batch, on device), eplb_host (host EPLB re-planned every --window
micro-batches from the mean of the last window's loads, as deployed systems do), topoep, topoep_homes
(topoep on home experts re-placed by jtopoep.homes from the mean loads of the --window micro-batches
before, wrapping round the trace, never the one planned; these count traces hold no co-activation;
the migration from the previous placement, costmodel.migration_seconds amortised over
--replace-every micro-batches, is charged to its weights term), taot, and
ideal (the baseline's pairs and token traffic spread perfectly evenly over the ranks, with no
planning or weight-transfer cost: costmodel.ideal_layer_time).
Settings: K = 2 guest slots (the headline), K = 1 and 4, half and double the inter-node bandwidth,
and --keep-microbatches micro-batches as the gradient-accumulation micro-batches of one optimizer
step, once fetching every copy and once where a rank that holds a guest copy again keeps it from the
previous micro-batch and ships no weights for it (moe.keep_copies; its gradients still go home).
The DeepSeek-V2-Lite traces hold 3 micro-batches of 32 ranks, so a fourth
repeats the first (never the one before it).
Guest weights travel in the layer's default slices of the hidden width (moe.guest_weight_chunks, as
the GPU's default tiled GEMM resolves it), priced by costmodel.exposed_weight_seconds.
Planning latency, at the planner shape each deployment runs (R, the preset's experts as the planner
sees them, K): for the planners on device (eplb, topoep, taot), the time benchmarks.kernels --target
h100 projects their kernels add inside a step (the kernels XLA:GPU compiles them to, times the
per-kernel cost of a line fitted to one H200's timings of the planners: a GPU runs them
launch-bound; benchmarks/results/kernels_h100.json); for eplb_host, its host time from the planner
benchmark (benchmarks/results/planners.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from benchmarks.data_path import relay_rows, token_batch
from benchmarks.planners import shape_key
from jtopoep import traces, xla_cpu
from jtopoep.config import CONFIG_DIR, ModelConfig, MoEConfig, section_from_dict
from jtopoep.costmodel import ExpertDims, ideal_layer_time, layer_time, migration_seconds
from jtopoep.gemm import resolve_weight_chunks
from jtopoep.homes import coactivation, replace_homes
from jtopoep.plan import home_plan
from jtopoep.planners import get_planner
from jtopoep.planners.eplb import even_quotas
from jtopoep.planners.routing import plan_from_quotas
from jtopoep.planners.eplb import eplb_slots
from jtopoep.topology import Topology

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODELS = ("mixtral-8x7b", "deepseek-v2-lite", "qwen1.5-moe", "deepseek-v3")
PLANNERS = ("none", "eplb", "eplb_host", "topoep", "topoep_homes", "taot", "ideal")
TOKENS_PER_GPU = 4096  # one 4096-token sequence per GPU per micro-batch
# taot's score weights for time rather than weighted communication cost (a sensitivity setting).


def load_model(name: str) -> ModelConfig:
    return section_from_dict("model", ModelConfig, yaml.safe_load((CONFIG_DIR / "models" / f"{name}.yaml").read_text()))


@dataclasses.dataclass(frozen=True)
class Deployment:
    """How a model's experts map onto R expert-parallel ranks.

    Fewer experts than ranks (Mixtral: 8 on 32): each expert is split into R / E slices of its hidden
    width (expert-tensor parallelism, as Megatron-Core's ETP), and a routed pair visits every slice.
    Experts not divisible by R (Qwen1.5-MoE: 60): padded with experts that receive no tokens, one
    on each of ranks spread evenly over the mesh (as a deployment would spread 60 experts over 32
    GPUs), not all on the last ranks, which would leave those GPUs with no expert of their own."""
    model: ModelConfig
    num_ranks: int

    @property
    def slices(self) -> int:
        return max(1, self.num_ranks // self.model.num_experts)

    @property
    def num_experts(self) -> int:  # experts as the planner sees them
        e = self.model.num_experts * self.slices
        return -(-e // self.num_ranks) * self.num_ranks

    @property
    def dims(self) -> ExpertDims:
        hidden = self.model.expert_hidden // self.slices
        # Guest-weight slices as a GPU runs them: the default GEMM there is tiled.
        return ExpertDims(self.model.d_model, hidden, self.model.element_bytes,
                          resolve_weight_chunks(MoEConfig.guest_weight_chunks, "tiled", hidden))

    @property
    def padding(self) -> np.ndarray:
        """Planner expert ids of the empty padding experts: the last home slot of ranks
        floor(j R / P), j < P (P < R, so at most one per rank)."""
        home = self.num_experts // self.num_ranks
        pads = self.num_experts - self.model.num_experts * self.slices
        ranks = np.arange(pads) * self.num_ranks // max(pads, 1)
        return (ranks + 1) * home - 1

    def expand(self, counts: np.ndarray) -> np.ndarray:
        """[R, E_model] counts -> [R, E_planner]: slices repeat their expert's pairs; padding is empty."""
        out = np.zeros((counts.shape[0], self.num_experts), np.int32)
        real = np.setdiff1d(np.arange(self.num_experts), self.padding)
        out[:, real] = np.repeat(counts, self.slices, axis=1)
        return out


def model_traces(model: str, num_ranks: int, steps: int, recorded: str | None) -> np.ndarray:
    """int32 [M, layers, R, E_model] micro-batches of real routing for the model's MoE layers."""
    cfg = load_model(model)
    pairs = TOKENS_PER_GPU * cfg.top_k
    layers = cfg.num_moe_layers
    if recorded:
        rec = traces.load_recorded(recorded)  # [micro-batches, layers, r, e]
        totals = rec.sum(2)  # expert loads per step and layer
        per = [[traces.olmoe_microbatches(totals[m % len(totals), l % totals.shape[1]], num_ranks, TOKENS_PER_GPU,
                                          cfg.top_k, 1, num_experts=cfg.num_experts if cfg.num_experts % totals.shape[2] == 0
                                          else None, seed=m * 1000 + l)[0] for l in range(layers)] for m in range(steps)]
        return np.asarray(per, np.int32)
    if model == "mixtral-8x7b":
        totals = traces.load_olmoe("mistral", "arxiv")  # Mixtral's own routing, layers (0, 7, 15)
        return np.stack([np.stack([traces.olmoe_microbatches(totals[l % 3], num_ranks, TOKENS_PER_GPU, cfg.top_k, 1,
                                                             seed=m * 100 + l)[0] for l in range(layers)])
                         for m in range(steps)])
    if model == "qwen1.5-moe":
        totals = traces.load_olmoe("olmoe", "c4")  # 64 experts: Qwen's 60 padded to 64 take these shares
        mats = np.stack([np.stack([traces.olmoe_microbatches(totals[l % 3], num_ranks, TOKENS_PER_GPU, cfg.top_k, 1,
                                                             seed=m * 100 + l)[0] for l in range(layers)])
                         for m in range(steps)])
        return mats[..., : cfg.num_experts]
    samples = traces.load_esft("intent")
    # More ranks than traced samples (127): groups of 32 ranks each take one 32-rank micro-batch,
    # group g the micro-batch g after the step's, so the groups differ where the trace allows.
    group = min(num_ranks, 32)
    out = []
    for m in range(steps):
        per_layer = []
        for l in range(layers):
            batches = traces.esft_microbatches(samples, group, 1 + l % (samples.shape[1] - 1),
                                               num_experts=cfg.num_experts)
            ranks = np.concatenate([batches[(m + g) % len(batches)] for g in range(num_ranks // group)])
            per_layer.append(traces.scale_counts(ranks, pairs))
        out.append(np.stack(per_layer))
    return np.stack(out)


def token_traces(num_ranks: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V2-Lite's token-level routing (ESFT intent): (tokens [M, layers, R, T, k], counts
    [M, layers, R, E]), T = TOKENS_PER_GPU of whole prompts per rank, a fresh draw per micro-batch."""
    cfg = load_model("deepseek-v2-lite")
    tokens = np.stack([token_batch("intent", num_ranks, seed).transpose(2, 0, 1, 3) for seed in range(steps)])
    counts = np.zeros(tokens.shape[:3] + (cfg.num_experts,), np.int32)
    for m, layer, rank in np.ndindex(*tokens.shape[:3]):
        counts[m, layer, rank] = np.bincount(tokens[m, layer, rank].reshape(-1), minlength=cfg.num_experts)
    return tokens, counts


def non_moe_seconds(cfg: ModelConfig, topology: Topology) -> float:
    """Forward+backward seconds per micro-batch of everything but routed experts, per GPU:
    attention projections 8 D^2 and scores 2 L D FLOPs per token (causal), shared experts and dense
    FFN layers 6 D F, embedding and head 2 D V; x3 for the backward pass."""
    d, length = cfg.d_model, cfg.seq_len
    per_token = cfg.num_layers * (8 * d * d + 2 * length * d)
    per_token += cfg.num_moe_layers * 6 * d * cfg.shared_experts * cfg.expert_hidden
    per_token += (cfg.num_layers - cfg.num_moe_layers) * 6 * d * cfg.dense_hidden
    per_token += 2 * d * cfg.vocab_size
    return 3 * per_token * TOKENS_PER_GPU / (topology.flops * topology.mfu)


# One jitted function per planner (planners are frozen dataclasses, equal when their settings are):
# projections at the same deployment, in one process, trace and compile each planner once.
_jitted = functools.lru_cache(maxsize=None)(jax.jit)
_replace_homes = jax.jit(replace_homes, static_argnums=3)


def project(model: str, topology: Topology, guest_slots: int, latency_s: dict, mats: np.ndarray,
            window: int, min_gain: float, keep_copies: bool = False,
            knobs: dict | None = None, replace_every: int = 400, tokens: np.ndarray | None = None) -> dict:
    """Per-step terms, tokens/s and gains of every planner on the micro-batches `mats`.

    tokens: [M, layers, R, T, k] token-level routing behind `mats`, for the hierarchical dispatch:
    every plan's exchange is priced by its relays' rows (data_path.relay_rows), and topoep_homes
    learns co-activation too.

    keep_copies: the micro-batches are those of one optimizer step, and a guest copy a rank holds
    again from the previous micro-batch of the same layer ships no weights (moe.keep_copies).
    knobs: {planner name: its settings beyond the defaults}, e.g. taot's score weights."""
    if len(mats) < 2:
        raise ValueError("topoep_homes learns its placement from the other micro-batches: give at least 2")
    cfg = load_model(model)
    dep = Deployment(cfg, topology.num_ranks)
    dims = dep.dims
    placement = np.arange(dep.num_experts).reshape(topology.num_ranks, -1)
    planners = {name: _jitted(get_planner(name, topology=topology, num_experts=dep.num_experts,
                                         guest_slots=0 if name == "none" else guest_slots, min_gain=min_gain,
                                         dims=dims, **(knobs or {}).get(name, {})))
                for name in ("none", "eplb", "topoep", "taot")}
    terms = ("gemm_s", "exchange_s", "weights_s", "planning_s")
    totals = {p: dict.fromkeys(terms, 0.0) for p in PLANNERS}
    history = []
    held = {}  # (planner, layer) -> the guest experts of that layer's previous micro-batch
    homes = {}  # layer -> topoep_homes' placement
    zero_coact = jnp.zeros((dep.num_experts, dep.num_experts), jnp.float32)
    home = placement.shape[1]
    # Nothing held yet: all -1, which plans as held=None does, under the same compiled planner.
    nothing = {name: np.full((topology.num_ranks, 0 if name == "none" else guest_slots), -1, np.int32)
               for name in planners}

    def rows(m, layer, plan):
        return None if tokens is None else relay_rows(tokens[m][layer], plan, topology.gpus_per_node)

    def timed(name, layer, plan, planning_s, homes=placement, extra_weights_s=0.0):
        t = layer_time(plan, topology, dims, homes, planning_s, held.get((name, layer)), rows(m, layer, plan))
        t["weights_s"] += extra_weights_s
        if keep_copies:
            held[(name, layer)] = np.asarray(plan.slot_expert)[:, home:]
        for k in terms:
            totals[name][k] += t[k]

    for m, micro in enumerate(mats):
        for layer, raw in enumerate(micro):
            counts = dep.expand(raw)
            history.append((layer, counts))
            for name, fn in planners.items():
                plan = jax.device_get(fn(counts, placement, held.get((name, layer), nothing[name])))
                timed(name, layer, plan, latency_s.get(name, 0.0) if name != "none" else 0.0)
            # eplb_host: placement from the mean of the previous window's loads of this layer.
            past = [c for (l, c) in history[:-1] if l == layer][-window:]
            basis = np.mean(past, axis=0).astype(np.int32) if past else counts
            slot_expert, _ = eplb_slots(basis, placement, guest_slots, 0.0, np)
            quota = even_quotas(slot_expert, counts.sum(0).astype(np.int32), np)
            plan = plan_from_quotas(counts, slot_expert, quota, topology.gpus_per_node, False, np)
            timed("eplb_host", layer, plan, latency_s.get("eplb_host", 0.0) / window)
            # topoep_homes: homes re-placed from the other micro-batches' loads (the window before).
            others = [(m - j) % len(mats) for j in range(1, min(window, len(mats) - 1) + 1)]
            before = [dep.expand(mats[i][layer]) for i in others]
            coact = zero_coact if tokens is None else jnp.asarray(sum(
                np.asarray(coactivation(jnp.asarray(tokens[i][layer].reshape(-1, tokens.shape[-1])), dep.num_experts))
                for i in others), jnp.float32)
            old = homes.get(layer, placement)
            homes[layer] = np.asarray(_replace_homes(jnp.asarray(np.mean(before, axis=0).sum(0), jnp.float32), coact,
                                              jnp.asarray(old, jnp.int32), topology))
            moving = migration_seconds(old, homes[layer], topology, dims, replace_every=replace_every)
            plan = jax.device_get(planners["topoep"](counts, homes[layer], held.get(("topoep_homes", layer),
                                                                                     nothing["topoep"])))
            timed("topoep_homes", layer, plan, latency_s.get("topoep", 0.0), homes[layer], moving)
            home_only = jax.device_get(home_plan(jnp.asarray(counts), jnp.asarray(placement), 0))
            ideal = ideal_layer_time(home_only, topology, dims, rows(m, layer, home_only))
            for k in terms:
                totals["ideal"][k] += ideal[k]
    return step_rows(totals, len(mats), non_moe_seconds(cfg, topology), topology.num_ranks)


def step_rows(totals: dict, steps: int, non_moe: float, num_ranks: int) -> dict:
    """{row: per-step terms, step time, tokens/s, gain over `none` and share of `ideal`'s gain} from
    {row: each term summed over `steps` micro-batches}; totals must hold a `none` and an `ideal` row."""
    rows = {}
    for name, summed in totals.items():
        per_step = {k: v / steps for k, v in summed.items()}
        step_s = sum(per_step.values()) + non_moe
        rows[name] = {**per_step, "non_moe_s": non_moe, "step_s": step_s,
                      "tokens_per_s": TOKENS_PER_GPU * num_ranks / step_s}
    base = rows["none"]["tokens_per_s"]
    ideal_gain = rows["ideal"]["tokens_per_s"] / base - 1
    for row in rows.values():
        row["gain_vs_none"] = row["tokens_per_s"] / base - 1
        row["share_of_ideal_gain"] = row["gain_vs_none"] / ideal_gain if ideal_gain > 0 else 1.0
    return rows


def planning_latency(planners_path: pathlib.Path, kernels_path: pathlib.Path) -> dict:
    """{shape_key(R, E, K): {planner: seconds}}: eplb, topoep and taot at the time their kernels add
    inside a step on a GPU (kernels_h100.json), eplb_host at its host time where the planner benchmark
    measured it (R = 32; elsewhere its host planning is charged nothing, in its favour)."""
    for path, command in ((planners_path, "benchmarks.planners"), (kernels_path, "benchmarks.kernels --target h100")):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run python -m {command} first (planning latency comes "
                                    "from it)")
    projected = json.loads(kernels_path.read_text()).get("in_step_s_by_shape")
    if projected is None:
        raise KeyError(f"{kernels_path} has no in_step_s_by_shape (written without a fitted GPU latency line): "
                       "rerun python -m benchmarks.kernels --target h100")
    host = json.loads(planners_path.read_text()).get("latency_by_shape_us", {})
    return {key: {**{k: v for k, v in row.items() if k in ("eplb", "topoep", "taot")},
                  **({"eplb_host": host[key]["eplb_host"] * 1e-6} if "eplb_host" in host.get(key, {}) else {})}
            for key, row in projected.items()}


def deployment_latency(latency: dict, model: str, num_ranks: int, guest_slots: int) -> dict:
    """{planner: seconds} measured at the planner shape the model's deployment runs: its E as the
    planner sees it (Deployment.num_experts), R and K."""
    key = shape_key(num_ranks, Deployment(load_model(model), num_ranks).num_experts, guest_slots)
    if key not in latency:
        raise ValueError(f"no planning latency measured for {model}'s planner shape {key}; measured: "
                         f"{sorted(latency)} (benchmarks.planners.SHAPES lists what the planner benchmark times)")
    return latency[key]


def markdown(results: dict) -> str:
    chunks = ", ".join(f"{m} {c}" for m, c in results["weight_chunks"].items())
    lines = ["Projected from the cost model (jtopoep/costmodel.py) on real routing; guest weights in slices of the "
             f"hidden width as the GPU's tiled GEMM takes them by default (moe.guest_weight_chunks: {chunks}); "
             "planning latency at each deployment's planner shape (R, E as the planner sees it, K): on-device "
             "planners at the time their XLA:GPU kernels add inside a step, projected per kernel "
             "(benchmarks.kernels --target h100, a line fitted to one H200's planner timings), eplb_host at "
             "its measured host time. Not GPU measurements.", ""]
    for setting, models in results["settings"].items():
        lines.append(f"### {setting}")
        lines.append("")
        lines.append("| model | planner | tokens/s | vs none | share of ideal gain | MoE GEMM ms | exchange ms | "
                     "weights ms | planning ms | non-MoE ms |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for model, rows in models.items():
            for name, r in rows.items():
                lines.append(f"| {model} | {name} | {r['tokens_per_s']:,.0f} | {100 * r['gain_vs_none']:+.1f}% | "
                             f"{100 * r['share_of_ideal_gain']:.0f}% | {1e3 * r['gemm_s']:.1f} | "
                             f"{1e3 * r['exchange_s']:.1f} | {1e3 * r['weights_s']:.1f} | {1e3 * r['planning_s']:.2f} | "
                             f"{1e3 * r['non_moe_s']:.1f} |")
        lines.append("")
    return "\n".join(lines + gap_report(results))


def gap_report(results: dict) -> list[str]:
    """Where topoep and taot fall short of `ideal` at the headline setting, term by term (ms per step)."""
    lines = ["### Where the gap to ideal comes from (K=2, ms per step, planner minus ideal)", "",
             "| model | planner | share of ideal gain | MoE GEMM | exchange | weights | planning | largest term |",
             "|---|---|---|---|---|---|---|---|"]
    terms = ("gemm_s", "exchange_s", "weights_s", "planning_s")
    for model, rows in results["settings"][results["headline"]].items():
        for name in ("topoep", "topoep_homes", "taot"):
            gap = {k: 1e3 * (rows[name][k] - rows["ideal"][k]) for k in terms}
            worst = max(gap, key=gap.get)
            lines.append(f"| {model} | {name} | {100 * rows[name]['share_of_ideal_gain']:.0f}% | "
                         + " | ".join(f"{gap[k]:+.1f}" for k in terms) + f" | {worst[:-2]} |")
    return lines + [""]


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["settings"][results["headline"]]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.5), sharey=False)
    terms = [("non_moe_s", "non-MoE"), ("gemm_s", "MoE GEMM"), ("exchange_s", "token exchange"),
             ("weights_s", "guest weights"), ("planning_s", "planning")]
    for ax, (model, rows) in zip(np.atleast_1d(axes), models.items()):
        bottom = np.zeros(len(rows))
        for key, label in terms:
            values = np.array([1e3 * r[key] for r in rows.values()])
            ax.bar(list(rows), values, bottom=bottom, label=label)
            bottom += values
        ax.set_title(model)
        ax.margins(y=0.08)
        ax.set_ylabel("projected step ms (fwd+bwd, one micro-batch)")
        ax.tick_params(axis="x", rotation=45)
    np.atleast_1d(axes)[-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{results['topology']}, {results['headline']} (cost-model projection)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="h800-4x8")
    parser.add_argument("--model", action="append", choices=MODELS, help="repeatable; default: all presets")
    parser.add_argument("--trace", help="a routing trace recorded by the trainer (counts.npz)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--keep-microbatches", type=int, default=4,
                        help="micro-batches of one optimizer step in the settings that fetch or keep guest copies")
    parser.add_argument("--window", type=int, default=8, help="eplb_host re-planning period and window")
    parser.add_argument("--min-gain", type=float, default=0.0)
    parser.add_argument("--replace-every", type=int, default=400,
                        help="micro-batches between re-placements of topoep_homes (100 steps of 4), over which its "
                             "migration is amortised")
    parser.add_argument("--no-sensitivity", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    xla_cpu.configure()  # as the trainer does; the plans are the same either way, only faster to compute
    models = args.model or list(MODELS)
    latency = planning_latency(RESULTS / "planners.json", RESULTS / "kernels_h100.json")
    base_topology = Topology.preset(args.topology)
    mats = {m: model_traces(m, base_topology.num_ranks, args.microbatches, args.trace) for m in models}
    # (label, topology, K, guest copies kept between micro-batches, micro-batches per model, and
    # planner settings beyond the defaults)
    settings = [("K=2", base_topology, 2, False, mats, {})]
    if not args.no_sensitivity:
        half = dataclasses.replace(base_topology, inter_bw=base_topology.inter_bw / 2)
        double = dataclasses.replace(base_topology, inter_bw=base_topology.inter_bw * 2)
        one_step = {m: model_traces(m, base_topology.num_ranks, args.keep_microbatches, args.trace) for m in models}
        steps = f"{args.keep_microbatches} micro-batches a step"
        settings += [("K=1", base_topology, 1, False, mats, {}), ("K=4", base_topology, 4, False, mats, {}),
                     ("K=2, inter-node bandwidth x0.5", half, 2, False, mats, {}),
                     ("K=2, inter-node bandwidth x2", double, 2, False, mats, {}),
                     (f"K=2, {steps}, every copy fetched", base_topology, 2, False, one_step, {}),
                     (f"K=2, {steps}, guest copies kept between them", base_topology, 2, True, one_step, {})]
    if "deepseek-v2-lite" in models:  # the hierarchical dispatch needs token-level routing: this model's
        tokens, counts = token_traces(base_topology.num_ranks, args.microbatches)
        settings.append(("K=2, hierarchical dispatch on token-level routing (DeepSeek-V2-Lite only)", base_topology,
                         2, False, {"deepseek-v2-lite": counts}, {}, tokens))
    results = {"topology": args.topology, "tokens_per_gpu": TOKENS_PER_GPU, "min_gain": args.min_gain,
               "weight_chunks": {m: Deployment(load_model(m), base_topology.num_ranks).dims.weight_chunks
                                 for m in models},
               "planning_latency_s": latency, "headline": "K=2", "settings": {}}
    for label, topology, k, keep, micro, knobs, *tokens in settings:
        results["settings"][label] = {m: project(m, topology, k, deployment_latency(latency, m, topology.num_ranks, k),
                                                 micro[m], args.window, args.min_gain, keep, knobs=knobs,
                                                 replace_every=args.replace_every, tokens=(tokens or [None])[0])
                                      for m in micro}
        print(label, "done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.json").write_text(json.dumps(results, indent=1))
    (args.out / "cluster.md").write_text(markdown(results))
    plot(results, args.out / "cluster.png")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
