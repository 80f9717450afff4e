"""The GPU's SM clock and power draw sampled while a benchmark runs (nvidia-smi every 100 ms): whether the
card held its clock or hit its power limit. Nothing is sampled where nvidia-smi is absent (CPU runs)."""

from __future__ import annotations

import shutil
import statistics
import subprocess


class ClockSampler:
    def __enter__(self) -> ClockSampler:
        self.samples: list[tuple[float, float]] = []  # (SM MHz, W)
        smi = shutil.which("nvidia-smi")
        query = ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"]
        self._smi = subprocess.Popen([smi, *query], stdout=subprocess.PIPE, text=True) if smi else None
        return self

    def __exit__(self, *exc) -> None:
        if self._smi is None:
            return
        self._smi.terminate()
        for row in self._smi.communicate()[0].splitlines():
            try:
                clock, watts = (float(v) for v in row.split(","))
            except ValueError:  # "[N/A]" or a partial last row
                continue
            self.samples.append((clock, watts))

    def summary(self, part: slice = slice(None)) -> str:
        """Mean clock and power over `part` of the samples, e.g. slice(n // 2, None) for the second half."""
        chosen = self.samples[part]
        if not chosen:
            return "no clock samples (no nvidia-smi)"
        clock, watts = statistics.mean(c for c, _ in chosen), statistics.mean(w for _, w in chosen)
        return f"SM clock {clock:.0f} MHz, power {watts:.0f} W (mean of {len(chosen)} samples)"

    def mean_clock(self) -> float | None:
        return statistics.mean(c for c, _ in self.samples) if self.samples else None

    def under_load(self, share: float = 0.6) -> tuple[float, float] | None:
        """(mean SM MHz, mean W) over the samples drawing at least `share` of the highest power seen: a
        training run's steps, not its start-up and compile (which draw a fraction of it)."""
        if not self.samples:
            return None
        top = max(w for _, w in self.samples)
        loaded = [(c, w) for c, w in self.samples if w >= share * top]
        return statistics.mean(c for c, _ in loaded), statistics.mean(w for _, w in loaded)
