"""The load families every benchmark uses: real traces mapped onto the mesh, and synthetic loads.

All are count matrices [R, E] of one micro-batch and layer, at `tokens_per_rank` tokens per rank.
The real traces hold short prompts (ESFT: ~65 tokens per sample); their per-rank expert shares are
scaled to production micro-batch sizes (jtopoep.traces.scale_counts), which keeps the routing skew of
the data and the drift between micro-batches, and makes copy-versus-transfer trade-offs realistic.
"""

from __future__ import annotations

import numpy as np

from jtopoep import traces


def real_families(num_ranks: int, num_experts: int, tokens_per_rank: int, quick: bool = False) -> dict:
    out = {}
    for task in traces.ESFT_TASKS:
        samples = traces.load_esft(task)
        layers = range(1, samples.shape[1], 8 if quick else 1)  # layer 0 of DeepSeek-V2-Lite is dense
        mats = [m for layer in layers
                for m in traces.esft_microbatches(samples, num_ranks, layer, num_experts=num_experts)]
        out[f"esft-{task}"] = np.stack([traces.scale_counts(m, tokens_per_rank * 6) for m in mats])
    mats = []
    for domain in ("arxiv", "github", "wikipedia") if quick else ("arxiv", "book", "c4", "github", "wikipedia", "tulu"):
        totals = traces.load_olmoe("olmoe", domain)
        for layer in range(totals.shape[0]):
            mats.extend(traces.olmoe_microbatches(totals[layer], num_ranks, tokens_per_rank, 8, 2,
                                                  num_experts=num_experts, seed=layer))
    out["olmoe"] = np.stack(mats)
    return out


def synthetic_families(num_ranks: int, num_experts: int, tokens_per_rank: int, steps: int = 16) -> dict:
    out = {f"zipf-{s}": traces.zipf(num_ranks, num_experts, tokens_per_rank, 8, s, steps=steps,
                                    drift=max(1, num_experts // 32), seed=int(s * 10))
           for s in (0.6, 1.0, 1.2)}
    out["bursts"] = traces.bursts(num_ranks, num_experts, tokens_per_rank, 8, steps, share=0.6, every=2)
    return out


def all_families(num_ranks: int, num_experts: int, tokens_per_rank: int, quick: bool = False) -> dict:
    steps = 4 if quick else 16
    return {**real_families(num_ranks, num_experts, tokens_per_rank, quick),
            **synthetic_families(num_ranks, num_experts, tokens_per_rank, steps)}
