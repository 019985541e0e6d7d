"""Loss curves of one or more runs (train and validation) drawn into a PNG.

matplotlib is imported only when plotting, and through its object-oriented API (no pyplot,
no global backend switch), so this works headless and inside other programs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from triton_transformer.training.checkpoint import METRICS_NAME

__all__ = ["X_AXES", "plot_runs", "read_metrics"]

# x-axis choice -> (metrics.jsonl key, axis label)
X_AXES = {
    "step": ("step", "optimizer step"),
    "tokens": ("tokens", "training tokens (bytes)"),
    "time": ("train_time_s", "training time (s, excluding evaluation)"),
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl (a path to the file itself works too)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_NAME} at {path}: is {run_dir} a run directory?")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    return records


def plot_runs(
    run_dirs: Sequence[str | Path],
    output: str | Path = "loss.png",
    *,
    labels: Sequence[str] | None = None,
    x: str = "step",
    title: str | None = None,
) -> Path:
    """Draw train (solid) and validation (dashed, dots) loss of each run; returns the PNG path.

    labels: one per run (default: the run directory's name).
    x: "step", "tokens" or "time" (training seconds, for comparing implementations).
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"got {len(labels)} labels for {len(run_dirs)} runs")
    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, got {x!r}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None

    x_key, x_label = X_AXES[x]
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = 0
    for i, run_dir in enumerate(run_dirs):
        records = [r for r in read_metrics(run_dir) if x_key in r]
        label = labels[i] if labels is not None else Path(run_dir).resolve().name
        color = f"C{i % 10}"
        train = [r for r in records if "loss" in r]
        val = [r for r in records if "val_loss" in r]
        drawn += len(train) + len(val)
        if train:
            xs, ys = [r[x_key] for r in train], [r["loss"] for r in train]
            ax.plot(xs, ys, color=color, lw=1.2, label=f"{label} train")
        if val:
            xs, ys = [r[x_key] for r in val], [r["val_loss"] for r in val]
            ax.plot(xs, ys, color=color, ls="--", marker="o", ms=3, lw=1.2, label=f"{label} valid")
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss (nats / byte)")
    # bits per byte on the right: the same curves, divided by ln 2
    ax.secondary_yaxis(
        "right", functions=(lambda v: v / math.log(2), lambda b: b * math.log(2))
    ).set_ylabel("bits / byte")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    else:  # a run that has not logged yet: an empty plot that says so
        ax.text(0.5, 0.5, "no records yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title or "loss")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return output
