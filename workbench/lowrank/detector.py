"""When to switch to low rank: pure arithmetic over per-layer signal trajectories, kept apart
from the loop hooks (cuttlefish.py) so that it is unit-testable without a model.

Everything is measured in units of training progress, not checks: a layer's signal (a level
normalized to its full rank, e.g. the rank it would get now / min(m, n)) becomes a rate of
change per 1% of training, smoothed by an EMA whose time constant is a share of training, and a
layer latches as stable once its smoothed rate has stayed below the threshold for `window_pct`
of training after the end of LR warm-up. A criterion per check would scale with the check
interval: the same run checked 4x as often sees 4x smaller changes per check and fires early.
Per 1% of training, the rate (and the smoothing, and the window) describe the trajectory, not
how often it was sampled.

A latched layer stays latched (Cuttlefish): a settled layer's rank jitters by a unit now and
then, and re-opening it would let the slowest, noisiest layer hold the switch back forever.
When all but a few layers have latched (at most `straggler_frac` of them, and at least one, are
open), the rest get a threshold multiplied by `straggler_relax`, so that a few slow layers delay
the switch a little, not to the cap. A share, not a count: a few slow layers of one kind (the
value projections, say) held the switch of a model of many layers to the cap when only one
straggler was allowed (the README's low-rank section has the case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Criterion:
    """The thresholds, all in % of training (rates in signal units per 1% of training)."""

    threshold: float  # smoothed |rate| below which a layer counts as settled
    smooth_pct: float  # EMA time constant of the rate
    window_pct: float  # how long a layer must stay below the threshold to latch
    warmup_pct: float  # end of LR warm-up: nothing before it counts toward a window
    straggler_frac: float = 0.1  # at most this share of layers open: they are stragglers
    straggler_relax: float = 2.0  # their threshold is multiplied by this


class SwitchDetector:
    """Per layer: the last level and progress, the smoothed rate, since when it is below the
    threshold, and whether it has latched."""

    def __init__(self, crit: Criterion):
        self.crit = crit
        self.last: dict[str, tuple[float, float]] = {}  # name -> (progress %, level)
        self.rate: dict[str, float] = {}  # smoothed d level / d progress, per 1%
        self.below_since: dict[str, float | None] = {}  # progress % it went below
        self.prev_rate: dict[str, float] = {}  # the smoothed rate at the check before
        self.step_pct: dict[str, float] = {}  # progress between the last two checks
        self.latched: dict[str, float] = {}  # name -> progress % at which it latched

    def observe(self, progress_pct: float, levels: dict[str, float]) -> None:
        """Levels of every layer at `progress_pct` (% of training done)."""
        for name, level in levels.items():
            prev = self.last.get(name)
            self.last[name] = (progress_pct, level)
            if prev is None or progress_pct <= prev[0]:
                self.below_since.setdefault(name, None)
                continue
            dp = progress_pct - prev[0]
            raw = (level - prev[1]) / dp  # signed: jitter cancels, a trend does not
            self.step_pct[name] = dp
            if name not in self.rate:
                self.rate[name] = raw  # seeded with the first rate: no start-up lag
            else:
                self.prev_rate[name] = self.rate[name]
                # exact for a rate held constant between checks, whatever their spacing
                keep = math.exp(-dp / self.crit.smooth_pct)
                self.rate[name] = keep * self.rate[name] + (1 - keep) * raw
        self._update_latches(progress_pct)

    def threshold(self, name: str) -> float:
        """The layer's current threshold: relaxed once it is one of the last stragglers."""
        few = max(1, math.floor(self.crit.straggler_frac * len(self.last))) \
            if self.crit.straggler_frac > 0 else 0
        if name not in self.latched and 0 < self.n_open() <= few and len(self.last) > few:
            return self.crit.threshold * self.crit.straggler_relax
        return self.crit.threshold

    def n_open(self) -> int:
        return len(self.last) - len(self.latched)

    def _update_latches(self, progress_pct: float) -> None:
        # twice: a latch in the first pass can make the rest stragglers, relaxed at once
        for _ in range(2):
            for name in sorted(self.last):
                if name in self.latched:
                    continue
                rate = abs(self.rate.get(name, math.inf))
                if rate >= self.threshold(name):
                    self.below_since[name] = None
                    continue
                since = self.below_since.get(name)
                if since is None:
                    since = self.below_since[name] = self._crossing(name, rate, progress_pct)
                start = max(since, self.crit.warmup_pct)
                # to the nearest check: a check every 2% of training would otherwise latch up
                # to 2% late, one every 0.5% at most 0.5% late
                if progress_pct + self.step_pct.get(name, 0.0) / 2 >= \
                        start + self.crit.window_pct - 1e-9:
                    self.latched[name] = progress_pct

    def _crossing(self, name: str, rate: float, progress_pct: float) -> float:
        """When the smoothed rate fell below the threshold, interpolated linearly between
        the last two checks (so that sparse checks do not delay the start of the window)."""
        before, dp = self.prev_rate.get(name), self.step_pct.get(name, 0.0)
        before = None if before is None else abs(before)
        thr = self.threshold(name)
        if before is None or before <= thr or before <= rate:
            return progress_pct
        return progress_pct - dp * (thr - rate) / (before - rate)

    def settled(self) -> bool:
        """Every layer latched."""
        return bool(self.last) and self.n_open() == 0

    def state_dict(self) -> dict[str, Any]:
        return {"last": {k: list(v) for k, v in self.last.items()}, "rate": dict(self.rate),
                "below_since": dict(self.below_since), "latched": dict(self.latched),
                "prev_rate": dict(self.prev_rate), "step_pct": dict(self.step_pct)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = {k: (float(v[0]), float(v[1])) for k, v in state["last"].items()}
        self.rate = dict(state["rate"])
        self.below_since = dict(state["below_since"])
        self.latched = dict(state["latched"])
        self.prev_rate, self.step_pct = dict(state["prev_rate"]), dict(state["step_pct"])


def should_switch(detector: SwitchDetector, step: int, total_steps: int, warmup_steps: int,
                  min_frac: float, max_frac: float) -> bool:
    """After step `step` (0-based), whether the next step is the first at low rank: never
    before the end of LR warm-up nor before min_frac of training, always on the last step
    that keeps the switch within max_frac, in between when every layer has latched."""
    if step + 1 < warmup_steps or (step + 1) / total_steps < min_frac:
        return False
    if forced(step, total_steps, max_frac):
        return True
    return detector.settled()


def forced(step: int, total_steps: int, max_frac: float) -> bool:
    """Switching after the next step would land past max_frac of training."""
    return (step + 2) / total_steps > max_frac
