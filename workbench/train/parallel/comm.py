"""Measured communication: a process group that forwards every collective to a real backend
(gloo on CPU, NCCL on GPUs) and counts the bytes each call moves, by kind.

Why a wrapper group rather than an estimate or the profiler: DDP's reducer (C++), FSDP2 (Python),
DTensor's functional collectives (C++) and the pipeline's send/recv all end in the methods of the
ProcessGroup object, so one subclass sees every byte the engine puts on the wire, with no
per-step profiler cost. Counting convention (bytes per rank, "payload"): all-reduce and broadcast
count the tensor; all-gather counts the gathered output; reduce-scatter counts the unreduced
input; point-to-point counts what this rank sends. Groups of one rank count nothing (nothing
leaves the rank).

The caller creates the `ByteCounter` and hands it to both `init_process_group` and the engine.
Every group the backend creates while that default group lives counts into it (DeviceMesh finds
groups by a name derived from their ranks, so a collective may reach an older group of the same
ranks). c10d registers a backend once per process, so the registered creator is told which
counter to use by each `init_process_group` call, rather than owning one.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from workbench import compat

KINDS = ("allreduce", "reduce_scatter", "allgather", "p2p", "broadcast", "other")
_BACKENDS = {"cpu": "wb_gloo", "cuda": "wb_nccl"}
_INNER = {"wb_gloo": "gloo", "wb_nccl": "nccl"}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ByteCounter:
    """Payload bytes by collective kind since the last reset, for every counting group of the
    process; `paused` leaves bookkeeping collectives out."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = defaultdict(int)
        # collectives issued: each one a point where every rank waits for the slowest
        self.calls = 0
        self.paused = False

    def reset(self) -> None:
        self.counts.clear()
        self.calls = 0

    def totals(self) -> Dict[str, int]:
        return {k: self.counts.get(k, 0) for k in KINDS}

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives inside are not counted (nested uses restore the outer state)."""
        outer, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = outer


class CountingGroup(dist.ProcessGroup):
    """A ProcessGroup that counts payload bytes per collective kind and delegates to `inner`."""

    def __init__(self, inner: Any, rank: int, size: int, backend_name: str,
                 counter: ByteCounter):
        super().__init__(rank, size)
        self.inner, self._rank, self._size = inner, rank, size
        self._backend_name = backend_name
        self._name, self._desc = "", ""
        self.counter = counter

    # --- identity (c10d and DeviceMesh ask for these) ---
    def getBackendName(self) -> str:
        return self._backend_name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _add(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        if not self.counter.paused and self._size > 1:
            self.counter.counts[kind] += _nbytes(tensors)
            self.counter.calls += 1

    # --- collectives ---
    def allreduce(self, tensors: List[torch.Tensor], opts=None):
        self._add("allreduce", tensors)
        return self.inner.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None):
        self._add("allreduce", tensors)
        return self.inner.allreduce_coalesced(tensors, opts)

    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts=None):
        self._add("allgather", [t for out in outputs for t in out])
        return self.inner.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        self._add("allgather", [output])
        return compat.allgather_base(self.inner, output, input, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor],
                                    inputs: List[torch.Tensor], opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_after_waiting(works)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts=None):
        self._add("reduce_scatter", [t for inp in inputs for t in inp])
        return self.inner.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        self._add("reduce_scatter", [input])
        return compat.reduce_scatter_base(self.inner, output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _last_after_waiting(works)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def broadcast(self, tensors: List[torch.Tensor], opts=None):
        self._add("broadcast", tensors)
        return self.inner.broadcast(tensors, opts)

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0):
        self._add("p2p", tensors)
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0):
        return self.inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0):
        return self.inner.recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        return self.inner.barrier(opts) if opts is not None else self.inner.barrier()

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        self._add("other", [input])
        return self.inner.alltoall_base(output, input, output_splits, input_splits, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        self._add("other", inputs)
        return self.inner.alltoall(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts=None):
        self._add("other", [t for inp in inputs for t in inp])
        return self.inner.scatter(outputs, inputs, opts)

    def gather(self, outputs, inputs, opts=None):
        self._add("other", inputs)
        return self.inner.gather(outputs, inputs, opts)

    def reduce(self, tensors, opts=None):
        self._add("other", tensors)
        return self.inner.reduce(tensors, opts)

    def __repr__(self) -> str:
        return f"CountingGroup({self._backend_name}, rank {self._rank} of {self._size})"


def _last_after_waiting(works: list):
    """Coalesced calls are issued one by one (gloo has no coalesced all-gather); wait for all
    but the last so the returned work completes the batch."""
    for w in works[:-1]:
        w.wait()
    return works[-1]


class _Creator:
    """What c10d calls to create each group of a counting backend: the real backend's group
    wrapped in a CountingGroup that counts into `counter` (set by init_process_group)."""

    def __init__(self, backend_name: str):
        self.backend_name = backend_name
        self.counter = ByteCounter()

    def __call__(self, store: Any, rank: int, size: int, timeout: timedelta) -> CountingGroup:
        if _INNER[self.backend_name] == "gloo":
            inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        else:
            inner = dist.ProcessGroupNCCL(store, rank, size, compat.nccl_options(timeout))
        return CountingGroup(inner, rank, size, self.backend_name, self.counter)


_CREATORS: Dict[str, _Creator] = {}  # c10d's registry is process-wide: one per backend name


def _counting_backend(device_type: str, counter: ByteCounter) -> str:
    """The counting backend's name for a device type (registered with c10d on first use),
    pointed at `counter` for the groups created from now on."""
    name = _BACKENDS[device_type]
    if name not in _CREATORS:
        _CREATORS[name] = _Creator(name)
        if not compat.backend_registered(name):
            dist.Backend.register_backend(name, _CREATORS[name], devices=[device_type])
    _CREATORS[name].counter = counter
    return name


def init_process_group(device_type: str, rank: int, world_size: int, counter: ByteCounter,
                       timeout_s: float = 600.0, store: Optional[Any] = None) -> None:
    """Initialise the default group with the counting backend, counting into `counter` (which
    the caller also hands to the engine). Rendezvous through `store` when given, else env://
    from torchrun (MASTER_ADDR, MASTER_PORT). Called once per rank through `process_group`.
    WORKBENCH_COUNT_COMM=0 uses the plain backend instead (comm/* metrics are then 0): an escape
    hatch should a backend feature the wrapper does not forward be needed (it has been verified
    on gloo; NCCL through the wrapper is not verified yet)."""
    if os.environ.get("WORKBENCH_COUNT_COMM", "1") == "0":
        backend = "nccl" if device_type == "cuda" else "gloo"
    else:
        backend = _counting_backend(device_type, counter)
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                            timeout=timedelta(seconds=timeout_s))


@contextmanager
def process_group(device_type: str, rank: int, world_size: int, counter: ByteCounter,
                  timeout_s: float = 600.0, store: Optional[Any] = None) -> Iterator[None]:
    """The default group for as long as the block runs, destroyed after it even on error.
    One rank rendezvouses with itself in memory (a HashStore: no port, no file), so a world of
    one is the same engine and checkpoint code as a world of many."""
    if store is None and world_size == 1:
        store = dist.HashStore()
    init_process_group(device_type, rank, world_size, counter, timeout_s, store)
    try:
        yield
    finally:
        dist.destroy_process_group()


def metric_dict(per_rank_mean: Dict[str, float], calls: float = 0.0) -> Dict[str, float]:
    """The tracked names: comm/<kind>_bytes for the four kinds the issue names, their sum
    over all kinds (broadcast and the rest included) as comm/bytes_per_step, and the counted
    collectives of the step as comm/collectives_per_step (each pays a latency and waits for
    the slowest rank, whatever its size: the cost model's per-collective term)."""
    out = {f"comm/{k}_bytes": per_rank_mean.get(k, 0.0)
           for k in ("allreduce", "reduce_scatter", "allgather", "p2p")}
    out["comm/bytes_per_step"] = float(sum(per_rank_mean.get(k, 0.0) for k in KINDS))
    out["comm/collectives_per_step"] = float(calls)
    return out
