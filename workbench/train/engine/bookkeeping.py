"""The collectives that are not the model's traffic: the step's metrics and stop signal, and
objects gathered or broadcast for the loop hooks and checkpoints.

They run through the same process group as training, so the byte counter would count them;
everything here runs uncounted, and the comm/* metrics stay what the layout itself moves. A
world of one rank agrees with itself without a collective.
"""

from __future__ import annotations

import resource
from contextlib import AbstractContextManager
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from workbench.train.parallel import comm


def cpu_peak_rss_bytes() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def local_peak_mem_bytes(device: torch.device) -> float:
    """This rank's peak memory: allocated on its GPU, resident on the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return cpu_peak_rss_bytes()


class Bookkeeping:
    """Uncounted collectives over every rank of the run; `counter` is the one the process
    group counts into (comm.process_group)."""

    def __init__(self, counter: comm.ByteCounter, device: torch.device, rank: int,
                 world_size: int):
        self.counter, self.device = counter, device
        self.rank, self.world_size = rank, world_size

    def uncounted(self) -> AbstractContextManager:
        """Collectives inside are left out of the comm/* metrics."""
        return self.counter.uncounted()

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: List[Any] = [None] * self.world_size
        with self.uncounted():
            dist.all_gather_object(out, obj)
        return out

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank: one decision for all."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self.uncounted():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            with self.uncounted():
                dist.barrier()

    def step_stats(self, stop: bool) -> Tuple[Dict[str, float], bool]:
        """This step's peak memory (max over ranks), bytes by kind (mean over ranks) and the
        stop signal (true everywhere if true on one rank: a signal that reached only some
        ranks), in one all-gather, so that every rank stops at the same step."""
        counts = self.counter.totals()
        row = [float(counts[k]) for k in comm.KINDS] + [
            local_peak_mem_bytes(self.device), 1.0 if stop else 0.0, float(self.counter.calls)]
        vec = torch.tensor(row, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            out = torch.empty(self.world_size * vec.numel(), dtype=torch.float64,
                              device=self.device)
            with self.uncounted():
                dist.all_gather_single(out, vec)
            vec = out
        table = vec.view(self.world_size, len(row))
        n = len(comm.KINDS)
        stats = {"peak_mem_bytes": float(table[:, n].max()),
                 **comm.metric_dict(dict(zip(comm.KINDS, table[:, :n].mean(dim=0).tolist())),
                                    float(table[:, n + 2].mean()))}
        return stats, bool(table[:, n + 1].max() > 0)


def solo(device: torch.device = torch.device("cpu")) -> Bookkeeping:
    """The bookkeeping of a process that is its own world and has no process group (the
    driver converting a checkpoint, a unit test): no collective is ever issued."""
    return Bookkeeping(comm.ByteCounter(), device, 0, 1)
