"""How the profiler times one operation: warmed up, repeated until the clock resolves it, the
median of several trials.

The median, not the mean: on a machine other jobs share, one trial in several is slowed by a
neighbour; the median is what a training step of many such operations sees.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall time covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], device: torch.device, min_trial_s: float = 0.01,
             trials: int = 5, max_reps: int = 10_000) -> float:
    """Median seconds of one call of `fn` over `trials` trials, each at least `min_trial_s`
    long (a microsecond operation is repeated until the trial is long enough to time)."""
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
    return statistics.median(samples)
