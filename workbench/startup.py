"""Fewer cyclic-garbage-collector passes in the workbench's own processes.

A run's process imports torch, torch._dynamo (every torch.optim optimizer imports it when it is
built) and MLflow: millions of objects that live as long as the process. CPython's default
thresholds (700, 10, 10) start a young-generation pass every 700 net allocations of container
objects and re-scan the older generations as they grow, so while those modules load the
collector keeps scanning objects that never become garbage: measured here, 1.9 of 12 CPU
seconds of a one-step `python -m workbench.run` (benchmarks/loop_overhead.py prints the
time to the first step both ways). Every rank of a job and every trial of a sweep pays it.

Raising the young threshold keeps the collector on (cycles are still freed; at most
`YOUNG_OBJECTS` more container objects wait for a pass) while it scans some 70 times less
often. Called first by each entry point (`cli.guarded`, the rank entry, the Slurm task, the
multi-rank test groups); a process that imports the workbench as a library keeps its own.
"""

from __future__ import annotations

import gc

# Net container allocations between young-generation passes (CPython: 700). At 50,000 a
# one-step run spends within 0.3 CPU-s of what it does with the collector off.
YOUNG_OBJECTS = 50_000
# Young passes per middle pass, middle passes per full pass (CPython: 10, 10).
MIDDLE_EVERY = 20
OLD_EVERY = 10


def fewer_gc_passes() -> None:
    """Set the thresholds above for this process (idempotent)."""
    gc.set_threshold(YOUNG_OBJECTS, MIDDLE_EVERY, OLD_EVERY)
