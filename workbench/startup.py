"""Fewer cyclic-garbage-collector passes while a workbench process starts.

A run's process imports torch, torch._dynamo (every torch.optim optimizer imports it when it is
built) and MLflow: millions of objects that live as long as the process. CPython's default
thresholds (700, 10, 10) start a young-generation pass every 700 net allocations of container
objects and re-scan the older generations as they grow, so while those modules load the
collector keeps scanning objects that never become garbage: about a tenth of the CPU of a short
`python -m workbench.run` (benchmarks/loop_overhead.py prints it against CPython's defaults).
Every rank of a job and every trial of a sweep pays it.

So each entry point (`cli.guarded`, the rank entry, the Slurm task, the multi-rank test groups)
first raises the young threshold, which keeps the collector on but scans some 70 times less
often; and once the training loop has built its optimizer (the last of those imports), it
freezes what startup left (the collector never scans it again) and puts the thresholds back.
Kept raised while training they saved nothing: a 2-rank group of layout cases ran as much CPU as
with the defaults (with the freeze, 14% less), the loop's short-lived cycles (autograd and DTensor
objects holding tensors) waiting longer for a pass. A process that imports the workbench as a
library keeps its own settings.
"""

from __future__ import annotations

import gc
from typing import Optional, Tuple

# Net container allocations between young-generation passes while starting (CPython: 700). At
# 50,000 a one-step run spends within 0.3 CPU-s of what it does with the collector off.
YOUNG_OBJECTS = 50_000
# Young passes per middle pass, middle passes per full pass (CPython: 10, 10).
MIDDLE_EVERY = 20
OLD_EVERY = 10

_before: Optional[Tuple[int, int, int]] = None  # the thresholds to restore once training starts


def fewer_gc_passes() -> None:
    """Raise the thresholds for this process's startup (idempotent)."""
    global _before
    if _before is None:
        _before = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, MIDDLE_EVERY, OLD_EVERY)


def startup_done() -> None:
    """Freeze the startup heap and restore the thresholds `fewer_gc_passes` replaced; a no-op
    in a process that did not call it (or already did this)."""
    global _before
    if _before is not None:
        gc.freeze()
        gc.set_threshold(*_before)
        _before = None
