"""The collectives the layouts use, timed on the ranks and links they will use: all-reduce,
all-gather, reduce-scatter and point-to-point, for every group size and message size, as curves.

Groups are measured the way a layout uses them: the world cut into disjoint groups of one size,
all of them busy at once (every tensor-parallel group of a step reduces together), so that what
the groups share (a node's NIC, a host's cores) is shared while they are timed. A group whose
ranks sit on one node is `intra`, one that crosses nodes `inter`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class Partition:
    """Disjoint groups of equal size covering some ranks, and whether they cross nodes."""

    groups: tuple[tuple[int, ...], ...]
    span: str  # intra | inter

    @property
    def size(self) -> int:
        return len(self.groups[0])


def partitions(node_of: Sequence[int]) -> List[Partition]:
    """The groups to time, given each rank's node: consecutive ranks in groups of every power
    of two up to the world (inside a node while they fit in one), and one rank per node in
    groups of every size across nodes (what data parallelism over nodes uses)."""
    world = len(node_of)
    out: List[Partition] = []
    size = 2
    while size <= world:
        if world % size == 0:
            groups = tuple(tuple(range(i, i + size)) for i in range(0, world, size))
            span = "intra" if all(len({node_of[r] for r in g}) == 1 for g in groups) else "inter"
            out.append(Partition(groups, span))
        size *= 2
    nodes = sorted(set(node_of))
    per_node = world // len(nodes)
    if len(nodes) > 1 and per_node > 1:  # one rank per node: strided groups across nodes
        size = 2
        while size <= len(nodes):
            if len(nodes) % size == 0:
                groups = tuple(tuple(range(local + first * per_node, world, per_node))[:size]
                               for local in range(per_node)
                               for first in range(0, len(nodes), size))
                out.append(Partition(groups, "inter"))
            size *= 2
    return out


def _op(kind: str, nbytes: int, group: dist.ProcessGroup, members: tuple[int, ...],
        device: torch.device) -> Callable[[], None]:
    """One blocking call of `kind` moving `nbytes` of payload per rank (the convention of the
    engine's byte counter: the all-reduced tensor, the gathered output, the unreduced input,
    what a rank sends)."""
    n = len(members)
    elems = max(n, nbytes // 4 // n * n)
    rank = dist.get_rank()
    if kind == "all_reduce":
        t = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_gather":
        out = torch.empty(elems, device=device)
        part = torch.ones(elems // n, device=device)
        return lambda: dist.all_gather_single(out, part, group=group)
    if kind == "reduce_scatter":
        inp = torch.ones(elems, device=device)
        part = torch.empty(elems // n, device=device)
        return lambda: dist.reduce_scatter_single(part, inp, group=group)
    # p2p: neighbours in the group exchange a message each way; half the round is one transfer
    t = torch.ones(max(1, nbytes // 4), device=device)
    me = members.index(rank)
    peer = members[me ^ 1] if (me ^ 1) < n else members[me - 1]

    def exchange() -> None:
        if me % 2 == 0:
            dist.send(t, peer, group=group)
            dist.recv(t, peer, group=group)
        else:
            dist.recv(t, peer, group=group)
            dist.send(t, peer, group=group)

    return exchange


def _timed(fn: Callable[[], None], device: torch.device, calls: int) -> List[float]:
    """Seconds of each of `calls` calls (every member makes the same number: a collective
    that one rank calls once more than the others never returns)."""
    out: List[float] = []
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def curve(kind: str, part: Partition, sizes_bytes: Sequence[int], device: torch.device,
          groups: Dict[tuple[int, ...], Optional[dist.ProcessGroup]], slow_s: float,
          budget_s: float) -> List[Dict[str, float]]:
    """Median seconds of `kind` at each size in every group of `part` at once (the slowest
    group's median), stopping after the first size slower than `slow_s`: beyond it time grows
    linearly with bytes, which the cost model extrapolates."""
    rank = dist.get_rank()
    mine = next((g for g in part.groups if rank in g), None)
    rows: List[Dict[str, float]] = []
    for nbytes in sizes_bytes:
        dist.barrier()
        fn, first = None, 0.0
        if mine is not None:
            fn = _op(kind, nbytes, groups[mine], mine, device)
            first = _timed(fn, device, 2)[-1]  # the first call opens the group's connections
        # as many calls as fit the budget at the slowest member's pace, the same on every rank
        calls = int(min(20, max(3, budget_s / max(_slowest(first, device), 1e-6))))
        local = -1.0
        if fn is not None:
            half = 0.5 if kind == "p2p" else 1.0
            local = half * statistics.median(_timed(fn, device, calls))
        seconds = _slowest(local, device)
        rows.append({"bytes": float(nbytes), "s": seconds})
        if seconds > slow_s:
            break
    return rows


def _slowest(local: float, device: torch.device) -> float:
    """The largest of every rank's value (ranks outside the groups send -1)."""
    t = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def alone(part: Partition) -> Partition:
    """The partition's first group by itself: the collective of a run with only these ranks
    (on a CPU the idle ones leave their cores to it)."""
    return Partition(part.groups[:1], part.span)


def make_groups(parts: Sequence[Partition]) -> Dict[tuple[int, ...], Optional[dist.ProcessGroup]]:
    """One process group per distinct group of ranks (every rank creates every group, as
    torch.distributed requires, in the same order)."""
    groups: Dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}
    for part in parts:
        for members in part.groups:
            if members not in groups:
                groups[members] = dist.new_group(list(members))
    return groups
