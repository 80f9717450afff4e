"""`jaxdist plot RUN_DIR`: loss (train and validation) and throughput curves from RUN_DIR/metrics.jsonl
to RUN_DIR/curves.png."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(run_dir: str) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"jaxdist plot: {path} does not exist; give the run.out_dir of a run", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("jaxdist plot: needs matplotlib: pip install 'jaxdist[plot]'", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in rows], label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax_loss.plot(*zip(*val, strict=True), "o-", label="validation")
    ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in rows])
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    print(out)
    return 0
