"""A slower device on this CPU: a cgroup whose CPU bandwidth is capped, for the ranks of an
emulated slow pool (benchmarks/hetero_cpu.py).

Why a quota and not fewer threads: every rank already runs one intra-op thread (two ranks share
two cores), and one thread cannot be made fewer. A quota slows all of a rank's work (its
matmuls, memory traffic, Python and gloo) by a known factor, as a slower GPU does, and the
kernel enforces it every period whatever the other ranks do: a rank capped at 0.33 CPU runs at
most 3.3 ms of every 10 ms. A quota only caps; a rank that cannot get its share (other load on
the machine) is slower still, which the benchmark reports with the load average.

cgroup v2 (`cpu.max`, the unified hierarchy) when the cpu controller is enabled there, else
cgroup v1's cpu controller (`cpu.cfs_quota_us` / `cpu.cfs_period_us`). Needs root. Group names
carry this process's id, so two runs never collide.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import List, Optional, Type

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short: a stage of tens of ms must not fit in one period's burst


class QuotaUnavailable(RuntimeError):
    """CPU quotas cannot be set here (not root, no writable cpu controller); says which."""


def _controller_root() -> tuple[Path, int]:
    """(the folder new groups go in, cgroup version)."""
    unified = ROOT / "cgroup.controllers"
    if unified.exists() and "cpu" in unified.read_text().split():
        return ROOT, 2
    if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return ROOT / "cpu", 1
    raise QuotaUnavailable(f"no cgroup cpu controller under {ROOT} (v2 cpu.max or v1 cpu/)")


def unavailable_reason() -> str:
    """Why quotas cannot be set here, or '' when they can."""
    if os.geteuid() != 0:
        return "needs root (writing cgroups)"
    try:
        root, _ = _controller_root()
    except QuotaUnavailable as e:
        return str(e)
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return ""


def join(path: str) -> None:
    """Move the calling process (and the threads it starts later) into the group at `path`."""
    Path(path, "cgroup.procs").write_text(str(os.getpid()))


class CpuQuota:
    """A cgroup capped at `cpus` CPUs (0.5: half of one core) while the `with` block runs;
    processes call join(group.path) to enter it. Removed on exit, its leftovers moved out."""

    def __init__(self, name: str, cpus: float):
        if not cpus > 0:
            raise ValueError(f"cpus must be > 0, got {cpus}")
        why = unavailable_reason()
        if why:
            raise QuotaUnavailable(why)
        self.root, self.version = _controller_root()
        self.cpus = float(cpus)
        self.path = str(self.root / f"wb-{os.getpid()}-{name}")

    def __enter__(self) -> CpuQuota:
        p = Path(self.path)
        p.mkdir(exist_ok=True)
        quota_us = max(1000, int(self.cpus * PERIOD_US))
        if self.version == 2:
            (p / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        else:
            (p / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (p / "cpu.cfs_quota_us").write_text(str(quota_us))
        return self

    def pids(self) -> List[int]:
        text = Path(self.path, "cgroup.procs").read_text()
        return [int(x) for x in text.split()]

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        p = Path(self.path)
        if not p.exists():
            return
        for pid in self.pids():  # a rank still alive (killed on timeout) leaves first
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        try:
            p.rmdir()
        except OSError:
            pass
