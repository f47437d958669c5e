"""Expert loads for planners, benchmarks and tests: counts[R, E] per micro-batch and layer.

Real data, shipped in jtopoep/data/ (origins and licences in its README):
- ESFT / DeepSeek-V2-Lite: per-sample counts [samples, layers, 64]. Samples of a task are split into
  micro-batches and dealt round-robin to the source ranks, so successive micro-batches show the load
  drifting as a per-micro-batch planner sees it.
- ESFT token level: each token's routed experts [tokens, layers, k], for what counts cannot show
  (which experts a token chooses together).
- OLMoE / Mixtral: per-domain totals for layers (0, 7, 15), no per-sample split. A micro-batch is drawn
  from the domain's expert distribution (seeded multinomial), one draw per source rank.
When the mesh needs more experts than the model has, experts are tiled: expert e of copy c becomes
c * E + e, each copy fed different samples.

Synthetic: Zipf(s) over a random expert permutation, Zipf whose hot set drifts each step, and bursts
where one expert suddenly takes a large share. Every generator is seeded and deterministic.
"""

from __future__ import annotations

import gzip
import json
import pathlib

import numpy as np

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
ESFT_TASKS = ("intent", "translation")


def _require_file(path: pathlib.Path) -> pathlib.Path:
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} is missing; pass an existing file (the shipped traces are "
                                f"under {DATA_DIR})")
    return path


def _esft_file(task: str, kind: str, path) -> pathlib.Path:
    if task not in ESFT_TASKS:
        raise ValueError(f"unknown ESFT task {task!r}; known tasks: {list(ESFT_TASKS)}")
    return _require_file(pathlib.Path(path) if path else DATA_DIR / "esft_dsv2lite" / f"{task}_{kind}.npz")


def load_esft(task: str = "intent", path: str | pathlib.Path | None = None) -> np.ndarray:
    """int64 [samples, layers, experts] routed slots of DeepSeek-V2-Lite (ESFT) for one task."""
    file = _esft_file(task, "counts", path)
    with np.load(file) as archive:
        data = archive["counts"]
    if data.ndim != 3:
        raise ValueError(f"{file} has shape {data.shape}; expected [samples, layers, experts]")
    return data.astype(np.int64)


def load_esft_tokens(task: str = "intent", path: str | pathlib.Path | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(expert_ids int32 [tokens, layers, k], sample_start int64 [samples + 1]): each token's routed
    experts at each MoE layer of DeepSeek-V2-Lite (ESFT), and the first token of each prompt."""
    file = _esft_file(task, "tokens", path)
    with np.load(file) as archive:
        expert_ids, sample_start = archive["expert_ids"], archive["sample_start"]
    if expert_ids.ndim != 3 or sample_start[-1] != len(expert_ids):
        raise ValueError(f"{file}: expert_ids {expert_ids.shape} and sample_start ending at {sample_start[-1]}; "
                         f"expected [tokens, layers, k] with sample_start[-1] == tokens")
    return expert_ids.astype(np.int32), sample_start.astype(np.int64)


def _olmoe_models(path) -> dict:
    file = _require_file(pathlib.Path(path) if path else DATA_DIR / "olmoe" / "expert_counts.json.gz")
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt") as f:
        return json.load(f)["models"]


def load_olmoe(model: str = "olmoe", domain: str = "arxiv", kind: str = "expert_counts",
               path: str | pathlib.Path | None = None) -> np.ndarray:
    """int64 [layers=3, experts] total routed slots of one OLMoE/Mixtral model on one text domain."""
    data = _olmoe_models(path)
    if model not in data:
        raise ValueError(f"unknown model {model!r}; known models: {sorted(data)}")
    kinds = data[model]["kinds"]
    if kind not in kinds:
        raise ValueError(f"unknown kind {kind!r}; known kinds: {sorted(kinds)}")
    if domain not in kinds[kind]:
        raise ValueError(f"unknown domain {domain!r}; known domains: {sorted(kinds[kind])}")
    return np.asarray(kinds[kind][domain], dtype=np.int64)


def olmoe_models(path: str | pathlib.Path | None = None) -> list[str]:
    return sorted(_olmoe_models(path))


def tile_experts(counts: np.ndarray, num_experts: int) -> int:
    """Number of copies needed to tile the trace's experts up to num_experts (must divide)."""
    source = counts.shape[-1]
    if num_experts % source:
        raise ValueError(f"cannot tile {source} traced experts to {num_experts}: not a multiple")
    return num_experts // source


def esft_microbatches(samples: np.ndarray, num_ranks: int, layer: int, samples_per_rank: int = 1,
                      num_experts: int | None = None) -> np.ndarray:
    """int32 [M, R, E]: micro-batches of one layer, samples dealt round-robin to source ranks.

    Each micro-batch takes R * samples_per_rank consecutive samples; sample i of it goes to rank
    i % R. With num_experts > the traced count, copy c of the experts is fed the samples shifted by
    c micro-batches, so copies do not move in lockstep.
    """
    num_samples, num_layers, traced = samples.shape
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer = {layer} is out of range: the trace has layers [0, {num_layers})")
    num_experts = num_experts or traced
    copies = tile_experts(samples, num_experts)
    per_batch = num_ranks * samples_per_rank
    num_batches = num_samples // per_batch
    if num_batches == 0:
        raise ValueError(f"the trace has {num_samples} samples, fewer than one micro-batch of "
                         f"{num_ranks} ranks x {samples_per_rank} samples")
    out = np.zeros((num_batches, num_ranks, num_experts), np.int64)
    for m in range(num_batches):
        for c in range(copies):
            start = ((m + c) % num_batches) * per_batch
            block = samples[start:start + per_batch, layer]  # [R * spr, traced]
            per_rank = block.reshape(samples_per_rank, num_ranks, traced).sum(0)
            out[m, :, c * traced:(c + 1) * traced] = per_rank
    return out.astype(np.int32)


def _cap_probabilities(p: np.ndarray, top_k: int) -> np.ndarray:
    """An expert takes at most one of a token's k slots: cap each share at 1/k, spreading the excess."""
    p = p / p.sum()
    cap = 1.0 / top_k
    for _ in range(len(p)):
        over = p > cap
        if not over.any():
            break
        excess = (p[over] - cap).sum()
        p[over] = cap
        free = ~over & (p < cap)
        p[free] += excess * p[free] / p[free].sum()
    return p


def sample_counts(p: np.ndarray, num_ranks: int, tokens_per_rank: int, top_k: int,
                  rng: np.random.Generator) -> np.ndarray:
    """int32 [R, E]: each rank routes tokens_per_rank * top_k pairs drawn from distribution p."""
    p = _cap_probabilities(np.asarray(p, np.float64), top_k)
    counts = rng.multinomial(tokens_per_rank * top_k, p, size=num_ranks)
    for row in counts:
        # A draw can still give an expert more pairs than there are tokens; hand the excess to the
        # experts with room, in proportion to their share, until no expert exceeds one per token.
        while (row > tokens_per_rank).any():
            excess = np.maximum(row - tokens_per_rank, 0)
            row -= excess
            room = row < tokens_per_rank
            weights = np.where(room, p, 0.0)
            row += rng.multinomial(excess.sum(), weights / weights.sum())
    return counts.astype(np.int32)


def zipf_probabilities(num_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    weights = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s
    return weights[rng.permutation(num_experts)] / weights.sum()


def zipf(num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int, s: float, steps: int = 1,
         drift: int = 0, seed: int = 0) -> np.ndarray:
    """int32 [steps, R, E] Zipf(s) loads over a random expert permutation.

    drift > 0 moves the hot set: each step, `drift` random pairs of experts swap popularity.
    """
    rng = np.random.default_rng(seed)
    p = zipf_probabilities(num_experts, s, rng)
    out = np.empty((steps, num_ranks, num_experts), np.int32)
    for t in range(steps):
        for _ in range(drift if t else 0):
            a, b = rng.choice(num_experts, 2, replace=False)
            p[[a, b]] = p[[b, a]]
        out[t] = sample_counts(p, num_ranks, tokens_per_rank, top_k, rng)
    return out


def bursts(num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int, steps: int,
           share: float = 0.5, every: int = 4, s: float = 0.6, seed: int = 0) -> np.ndarray:
    """int32 [steps, R, E]: a mild Zipf base; every `every` steps one random expert suddenly takes
    `share` of a token's chance to pick it (capped at one slot per token)."""
    if not 0 < share <= 1:
        raise ValueError(f"share = {share} must be in (0, 1]")
    rng = np.random.default_rng(seed)
    base = zipf_probabilities(num_experts, s, rng)
    out = np.empty((steps, num_ranks, num_experts), np.int32)
    for t in range(steps):
        p = base.copy()
        if t % every == 0:
            hot = rng.integers(num_experts)
            p = p * (1 - share)
            p[hot] += share
        out[t] = sample_counts(p, num_ranks, tokens_per_rank, top_k, rng)
    return out


def olmoe_microbatches(totals: np.ndarray, num_ranks: int, tokens_per_rank: int, top_k: int, steps: int,
                       num_experts: int | None = None, seed: int = 0) -> np.ndarray:
    """int32 [steps, R, E] micro-batches drawn from one layer's traced expert distribution.

    totals: [experts] traced counts of one layer; tiled (each copy with its own draws) when the mesh
    needs more experts.
    """
    traced = totals.shape[-1]
    num_experts = num_experts or traced
    copies = tile_experts(totals, num_experts)
    p = np.tile(totals.astype(np.float64), copies)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    return np.stack([sample_counts(p, num_ranks, tokens_per_rank, top_k, rng) for _ in range(steps)])


def scale_counts(counts: np.ndarray, pairs_per_rank: int) -> np.ndarray:
    """Scale each rank's row to pairs_per_rank pairs, keeping its expert shares (largest remainder,
    ties to the lowest expert index), for projecting small traced samples onto production batch sizes."""
    counts = np.asarray(counts, np.float64)
    totals = counts.sum(-1, keepdims=True)
    if (totals == 0).any():
        raise ValueError("cannot scale a rank that routed no pairs")
    exact = counts / totals * pairs_per_rank
    out = np.floor(exact).astype(np.int64)
    short = pairs_per_rank - out.sum(-1)
    frac = exact - out
    order = np.argsort(-frac, axis=-1, kind="stable")
    ranks_of = np.argsort(order, axis=-1, kind="stable")
    out += (ranks_of < short[..., None]).astype(np.int64)
    return out.astype(np.int32)


def load_recorded(path: str | pathlib.Path) -> np.ndarray:
    """int32 [micro-batches, layers, R, E] routing counts recorded by the trainer (counts.npz): one entry
    per micro-batch, in order (train.microbatches per step; one per step by default)."""
    file = _require_file(pathlib.Path(path))
    with np.load(file) as data:
        if "counts" not in data:
            raise ValueError(f"{file} holds {sorted(data)}; expected an array named 'counts'")
        counts = data["counts"]
    if counts.ndim != 4:
        raise ValueError(f"{file}: counts has shape {counts.shape}; expected [micro-batches, layers, R, E]")
    return counts.astype(np.int32)
