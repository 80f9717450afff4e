"""`jaxdist plot RUN_DIR`: the curves of RUN_DIR/metrics.jsonl to RUN_DIR/curves.png.

Four panels under a title naming the run: loss (train and validation) on a log scale, where the
late, small changes are visible next to the first steps' large loss; throughput without the
windows that include compilation (each invocation's first, marked `includes_compile`, and the
file's first row, which always is one); the learning rate; the gradient norm (log scale). Panels
of metrics the run did not log say so; null values (not finite when logged) are gaps.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from jaxdist.train import metrics

PANELS = ("loss", "throughput", "learning rate", "gradient norm")


def _warn(message: str) -> None:
    print(f"jaxdist plot: warning: {message}", file=sys.stderr, flush=True)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows with a finite `key`."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def _throughput_rows(rows: list[dict]) -> list[dict]:
    """The rows whose tokens/s is the run's pace: not the first, nor any window that includes compiling."""
    return [r for i, r in enumerate(rows) if i > 0 and not r.get("includes_compile")]


def _draw(ax, rows: list[dict], key: str, title: str, ylabel: str, log: bool = False, label: str | None = None):
    steps, values = _series(rows, key)
    if not values:
        ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.plot(steps, values, label=label)
        if log and min(values) > 0:
            ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    return steps, values


def figure(rows: list[dict], title: str):
    """The matplotlib Figure of `rows` (metrics rows), titled `title`; its axes are in PANELS order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_loss, ax_tps, ax_lr, ax_norm = axes.flat
    _draw(ax_loss, rows, "loss", PANELS[0], "loss", log=True, label="train")
    val_steps, val = _series(rows, "val_loss")
    if val:
        ax_loss.plot(val_steps, val, "o-", label="validation")
        if ax_loss.get_yscale() == "log" and min(val) <= 0:
            ax_loss.set_yscale("linear")
    if ax_loss.lines:
        ax_loss.legend()
    _draw(ax_tps, _throughput_rows(rows), "tokens_per_s", PANELS[1], "tokens/s")
    _draw(ax_lr, rows, "lr", PANELS[2], "learning rate")
    _draw(ax_norm, rows, "grad_norm", PANELS[3], "gradient norm", log=True)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(run_dir: str) -> int:
    """Draw RUN_DIR/metrics.jsonl to RUN_DIR/curves.png; the CLI's exit status."""
    path = Path(run_dir) / metrics.FILE
    if not path.is_file():
        print(f"jaxdist plot: {path} does not exist; give the run.out_dir of a run", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("jaxdist plot: needs matplotlib: pip install 'jaxdist[plot]'", file=sys.stderr)
        return 2
    rows = metrics.read_rows(path, _warn)
    if not rows:
        print(f"jaxdist plot: {path} holds no metrics rows; plot a run that has logged a step", file=sys.stderr)
        return 2
    fig = figure(rows, f"{Path(run_dir).absolute().name} ({Path(run_dir).absolute()})")
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)  # left open: pyplot.gcf() is the figure drawn, for a caller in Python
    print(out)
    return 0
