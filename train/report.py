"""The end-of-run figure: loss, per-layer imbalance before/after planning, inter-node traffic."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from train.records import read_rows  # noqa: E402


def write_report(run_dir: pathlib.Path, planner: str, out=None):
    """Draw the run's metrics into `out` (a path or a binary file; run_dir/report.png by default)."""
    rows = read_rows(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [r["loss"] for r in train], label="train loss")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    axes[0].set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    axes[0].legend()
    num_layers = len(train[0]["imbalance_before"]) if train else 0
    for layer in range(num_layers):
        line, = axes[1].plot(steps, [r["imbalance_before"][layer] for r in train], "--", alpha=0.8,
                             label=f"layer {layer} before")
        axes[1].plot(steps, [r["imbalance_after"][layer] for r in train], color=line.get_color(),
                     label=f"layer {layer} after {planner}")
    axes[1].set(xlabel="step", ylabel="max / mean rank load", title="expert-parallel imbalance")
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [sum(r["inter_node_pairs"]) for r in train])
    axes[2].set(xlabel="step", ylabel="pairs (all MoE layers)", title="inter-node dispatched pairs")
    fig.tight_layout()
    out = run_dir / "report.png" if out is None else out
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return out
