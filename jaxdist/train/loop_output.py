"""What the training loop shows and writes: the metrics file, the progress bar or lines, the closing summary."""

from __future__ import annotations

import sys
from pathlib import Path

import jax

from jaxdist.train import metrics as metrics_lib
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.config import ConfigError, TrainConfig
from jaxdist.train.report import info, is_terminal, warn


def memory_gb(device) -> float | None:
    """GiB in use on `device`, where its backend reports it (GPUs do; the CPU does not)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats["bytes_in_use"] / 2**30 if stats and "bytes_in_use" in stats else None


class MetricsLog:
    """JSONL (and optionally TensorBoard) metrics, written by process 0."""

    def __init__(self, out_dir: Path, tensorboard: bool, start: int = 0):
        self.enabled = jax.process_index() == 0
        self.file = None
        if self.enabled:
            # rows of steps after `start` belong to an attempt that did not reach a checkpoint: they are trained again
            path = out_dir / metrics_lib.FILE
            metrics_lib.rewrite(path, [r for r in metrics_lib.read_rows(path, warn) if r["step"] <= start])
            self.file = metrics_lib.RowWriter(path)
        self.tb = None
        if tensorboard and self.enabled:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError("run.tensorboard=true needs tensorboardX: pip install tensorboardX") from None
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(row)  # one write of the whole line: a crash never leaves half a row before the next
        if self.tb:
            for k, v in row.items():
                if isinstance(v, int | float) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


class Summary:
    """The end-of-run line: steps, final loss, mean throughput (without the first, compiling, window)."""

    def __init__(self):
        self.rows, self.tokens, self.seconds = [], 0, 0.0

    def add(self, row: dict, tokens: int, seconds: float) -> None:
        if self.rows:  # the first window includes compilation
            self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.rows.append(row)

    def print(self, out_dir: Path, ckpt: Checkpoints | None, checkpoint_s: float = 0.0) -> None:
        if not self.rows:
            return
        last = self.rows[-1]
        tps = self.tokens / self.seconds if self.seconds else last["tokens_per_s"]
        if self.seconds and checkpoint_s > 0.05 * self.seconds:  # worth saying: the loop waited on the disk
            tps_note = f" ({checkpoint_s:.1f} s of it, {checkpoint_s / self.seconds:.0%}, waiting for checkpoint saves)"
        else:
            tps_note = ""
        where = f"metrics in {out_dir / 'metrics.jsonl'}"
        where += f", checkpoints in {ckpt.directory}" if ckpt else ", no checkpoints (run.checkpoint_every=-1)"
        info(f"done: step {last['step']}, final loss {last['loss']:.4f}, mean {tps:,.0f} tokens/s{tps_note}; {where}")


class Progress:
    """A tqdm bar on process 0 (or plain lines where there is no terminal)."""

    def __init__(self, cfg: TrainConfig, start: int, end: int):
        self.bar = None
        # a bar needs a terminal: under `jaxdist launch` (pipes) or in a log file, plain lines
        self.plain = not cfg.run.progress or jax.process_index() != 0 or not is_terminal(sys.stderr)
        if not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=end, initial=start, unit="step", dynamic_ncols=True)
        self.quiet = jax.process_index() != 0

    def update(self, step: int, row: dict) -> None:
        parts = [f"loss {row['loss']:.4f}", f"{row['tokens_per_s']:,.0f} tok/s"]
        if "val_loss" in row:
            parts.insert(1, f"val {row['val_loss']:.4f}")
        if "mfu" in row:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if "mem_gb" in row:
            parts.append(f"mem {row['mem_gb']:.1f} GiB")
        if row.get("checkpoint_s", 0) >= 0.01:
            parts.append(f"ckpt wait {row['checkpoint_s']:.2f} s")
        text = "  ".join(parts)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        elif not self.quiet:
            print(f"step {step}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
