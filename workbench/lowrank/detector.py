"""When the stable ranks have settled: pure arithmetic over stable-rank trajectories, kept apart
from the controller so that it is unit-testable without a model.

Each layer's change per check is smoothed by an EMA and normalized by the layer's stable rank at
initialization (so one epsilon fits narrow and wide layers); a layer is settled when the mean
absolute smoothed change over the last `window` checks falls below `epsilon`. A steady ramp
keeps a constant slope, so it never counts as settled.
"""

from __future__ import annotations

import math
from typing import Any


class SwitchDetector:
    """Per layer: the stable rank's change per check, smoothed by an EMA (seeded with the first
    change), and whether every layer's smoothed change has stayed small for a window.

    Smoothing the change rather than the value is the slope of an EMA-smoothed trajectory
    without the EMA's start-up lag: an EMA of values started at the first value makes a steady
    ramp look flat for its first few checks, and the detector would fire on it."""

    def __init__(self, ema: float, window: int, epsilon: float):
        self.ema, self.window, self.epsilon = ema, window, epsilon
        self.last: dict[str, float] = {}
        self.ref: dict[str, float] = {}
        self.slopes: dict[str, list[float]] = {}  # smoothed |change| / ref, last `window`

    def observe(self, srs: dict[str, float]) -> None:
        for name, sr in srs.items():
            if name not in self.last:
                self.last[name], self.ref[name] = sr, max(sr, 1e-12)
                self.slopes[name] = []
                continue
            change = (sr - self.last[name]) / self.ref[name]
            self.last[name] = sr
            hist = self.slopes[name]
            hist.append(change if not hist else self.ema * hist[-1] + (1 - self.ema) * change)
            del hist[:-self.window]

    def slope(self, name: str) -> float:
        """Mean |smoothed change per check| over the window, relative to the layer's stable
        rank at its first check; inf until the window is full."""
        hist = self.slopes.get(name, [])
        if len(hist) < self.window:
            return math.inf
        return sum(abs(x) for x in hist) / len(hist)

    def settled(self) -> bool:
        return bool(self.slopes) and all(self.slope(n) < self.epsilon for n in self.slopes)

    def state_dict(self) -> dict[str, Any]:
        return {"last": dict(self.last), "ref": dict(self.ref),
                "slopes": {k: list(v) for k, v in self.slopes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last, self.ref = dict(state["last"]), dict(state["ref"])
        self.slopes = {k: list(v) for k, v in state["slopes"].items()}


def should_switch(detector: SwitchDetector, step: int, total_steps: int,
                  min_frac: float, max_frac: float) -> bool:
    """After step `step` (0-based), whether the next step is the first at low rank: never
    before min_frac of training, always on the last step that keeps the switch within
    max_frac, in between when every layer is settled."""
    if (step + 1) / total_steps < min_frac:
        return False
    if forced(step, total_steps, max_frac):
        return True
    return detector.settled()


def forced(step: int, total_steps: int, max_frac: float) -> bool:
    """Switching after the next step would land past max_frac of training."""
    return (step + 2) / total_steps > max_frac
