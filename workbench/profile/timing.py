"""How the profiler times one operation: warmed up, repeated until the clock resolves it, the
fastest of several trials.

The fastest, not the mean or the median: a trial is only ever slowed down (by a neighbour on a
shared machine, an interrupt, a page fault), never sped up, so the fastest trial is the
operation's own cost; a training step adds up thousands of them, whose own delays the step's
median then sees once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """How long the profiler looks at each operation: `trials` trials of at least `trial_s`."""

    trial_s: float = 0.01
    trials: int = 5


def fastest_s(fn: Callable[[], object], device: torch.device, timing: Timing = Timing(),
             max_reps: int = 10_000) -> float:
    """Seconds of one call of `fn` in the fastest trial, each trial at least `timing.trial_s`
    long (a microsecond operation is repeated until the trial is long enough to time)."""
    min_trial_s, trials = timing.trial_s, timing.trials
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    one = max(time.perf_counter() - t0, 1e-7)
    reps = int(min(max_reps, max(1, min_trial_s / one)))
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) / reps)
    return min(samples)
