"""How many of the machine's cores a block of code had to itself, for benchmarks on cores shared
with other jobs (benchmarks/lowrank_scaling.py)."""

from __future__ import annotations

import os
import time
from typing import Any


class CpuShare:
    """`with CpuShare(cores) as cs:` ... `cs.free`: the cores the measured code had to itself,
    on average over the block: the machine's cores minus the CPU time every other process
    took meanwhile (/proc/stat user + nice + system of all cores, minus this process's and
    its reaped children's rusage; softirq, where the kernel moves the ranks' packets, is
    left out of both).

    Why: the cost model shares the cores among the ranks (N ranks on C cores compute N/C
    times as long), and the 2 cores of this machine are shared with other jobs: a step
    measured while they take a core is slower by a factor the model can only know if it is
    measured. One rank alone loses nothing to one busy neighbour on 2 cores; 4 ranks lose a
    fifth of their share to it (2/5 of a core each instead of 2/4)."""

    def __init__(self, cores: int):
        self.cores, self.free = cores, float(cores)

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        import resource

        return sum(r.ru_utime + r.ru_stime for r in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN)))

    def __enter__(self) -> CpuShare:
        self._t, self._busy, self._own = time.perf_counter(), self._busy_s(), self._own_s()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t
        others = (self._busy_s() - self._busy) - (self._own_s() - self._own)
        self.free = min(float(self.cores), max(0.25, self.cores - max(0.0, others) / wall))
