"""How the profiler times one operation: warmed up, repeated until the clock resolves it, the
median of several trials.

The median, not the fastest or the mean: a training step runs each operation at its typical
speed (cache state, frequency, the scheduler's jitter included), which the fastest trial
understates and one slow outlier would drag the mean from.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List

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


def median_s(fn: Callable[[], object], device: torch.device, timing: Timing = Timing(),
             max_reps: int = 10_000) -> float:
    """Median seconds of one call of `fn` over the trials, each at least `timing.trial_s` long
    (a microsecond operation is repeated until the trial is long enough to time)."""
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
    return statistics.median(samples)


def interleaved_medians(ops: Dict[Hashable, Callable[[], object]], device: torch.device,
                        timing: Timing = Timing()) -> Dict[Hashable, float]:
    """Median seconds of one call of each op, its trials taken in turn with the others' (every
    op once, then every op again): a slow spell of the machine then spoils one trial of each
    instead of every trial of one."""
    reps: Dict[Hashable, int] = {}
    for key, fn in ops.items():  # warm up, and repeat an op until a trial is long enough
        fn()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        reps[key] = max(1, int(timing.trial_s / max(time.perf_counter() - t0, 1e-7)))
    samples: Dict[Hashable, List[float]] = {key: [] for key in ops}
    for _ in range(timing.trials):
        for key, fn in ops.items():
            t0 = time.perf_counter()
            for _ in range(reps[key]):
                fn()
            synchronize(device)
            samples[key].append((time.perf_counter() - t0) / reps[key])
    return {key: statistics.median(v) for key, v in samples.items()}
