"""A cluster as measured by `python -m workbench.profile`: the curves of its cluster file, read
as functions the cost terms call instead of datasheet figures and efficiency coefficients.

Interpolation, never fitting: a GEMM's seconds between two measured token counts follow the
straight line between them in log-log space (and beyond the last, its FLOP rate), a collective's
seconds between two measured payloads likewise (beyond the last, its bandwidth), and a group size
that was not measured takes the nearest measured one scaled by the ring's (n-1)/n. A shape that
was not measured takes the FLOP rate of the nearest measured shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from workbench.config_profile import BlockTable, ClusterProfile, ComputeLevel, GemmTable

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
ProbeKey = Tuple[str, int, int]  # kind, degree, ranks busy
# tokens per rank, step s, reference s, optimizer step s (0: not measured)
ProbeRow = Tuple[float, float, float, float]


def loglog(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """ys(x) on the straight lines between measured points in log-log space; past the last
    point, y grows in proportion to x (a rate that no longer changes); before the first, y
    stays at the first (a floor: latency, launch overhead)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(xs)
    xs, ys = np.asarray(xs, float)[order], np.maximum(np.asarray(ys, float)[order], 1e-12)
    inside = np.exp(np.interp(np.log(np.maximum(x, xs[0])), np.log(xs), np.log(ys)))
    return np.where(x > xs[-1], ys[-1] * x / xs[-1], inside)


@dataclass(frozen=True)
class GemmCurves:
    """One dtype's GEMM table, grouped by shape."""

    shapes: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray, np.ndarray]]  # (k, n) ->
    # (tokens, fwd_s, bwd_s) ascending in tokens

    @classmethod
    def of(cls, table: GemmTable) -> GemmCurves:
        grouped: Dict[Tuple[int, int], List[Tuple[int, float, float]]] = {}
        for k, n, t, f, b in zip(table.k, table.n, table.tokens, table.fwd_s, table.bwd_s):
            grouped.setdefault((int(k), int(n)), []).append((t, f, b))
        return cls({key: tuple(np.array(c, float) for c in zip(*sorted(rows)))
                    for key, rows in grouped.items()})

    def seconds(self, tokens: np.ndarray, k: np.ndarray | float, n: np.ndarray | float,
                backward: bool = False) -> np.ndarray:
        """Seconds of (tokens, k) @ (k, n) (backward: its dX and dW GEMMs together), per row."""
        tokens, k, n = np.broadcast_arrays(np.asarray(tokens, float), np.asarray(k, float),
                                           np.asarray(n, float))
        out = np.empty(tokens.shape)
        for kk, nn in set(zip(k.ravel().tolist(), n.ravel().tolist())):
            rows = (k == kk) & (n == nn)
            key, scale = self._nearest(kk, nn)
            toks, fwd, bwd = self.shapes[key]
            out[rows] = scale * loglog(tokens[rows], toks, bwd if backward else fwd)
        return out

    def _nearest(self, k: float, n: float) -> Tuple[Tuple[int, int], float]:
        """The measured shape for (k, n) and the factor its time takes: 1 for the shape itself,
        else the ratio of FLOPs to the nearest measured shape in log space (its rate kept)."""
        key = (int(round(k)), int(round(n)))
        if key in self.shapes:
            return key, 1.0
        near = min(self.shapes, key=lambda s: (np.log(s[0] / k)) ** 2 + (np.log(s[1] / n)) ** 2)
        return near, (k * n) / (near[0] * near[1])


@dataclass(frozen=True)
class BlockCurves:
    """A model's whole block and loss per TP degree: what its GEMMs leave out, measured."""

    by_tp: Dict[int, Tuple[np.ndarray, ...]]  # tp -> tokens, fwd, bwd, loss_fwd, loss_bwd

    @classmethod
    def of(cls, table: BlockTable) -> BlockCurves:
        grouped: Dict[int, List[Tuple[float, ...]]] = {}
        for row in zip(table.tp, table.tokens, table.fwd_s, table.bwd_s, table.loss_fwd_s,
                       table.loss_bwd_s):
            grouped.setdefault(int(row[0]), []).append(row[1:])
        return cls({tp: tuple(np.array(c, float) for c in zip(*sorted(rows)))
                    for tp, rows in grouped.items()})

    def seconds(self, part: int, tokens: np.ndarray, tp: np.ndarray) -> Optional[np.ndarray]:
        """Column `part` (1 block fwd, 2 block bwd, 3 loss fwd, 4 loss bwd) per row; None when
        a row's TP degree was not measured."""
        tokens, tp = np.broadcast_arrays(np.asarray(tokens, float), np.asarray(tp, float))
        out = np.empty(tokens.shape)
        for degree in set(tp.ravel().tolist()):
            if int(degree) not in self.by_tp:
                return None
            rows = tp == degree
            curve = self.by_tp[int(degree)]
            out[rows] = loglog(tokens[rows], curve[0], curve[part])
        return out


@dataclass(frozen=True)
class Level:
    """One compute level of a profile: the speeds a rank sees while `ranks` share its host."""

    ranks: int
    threads: int
    gemm: Dict[str, GemmCurves]
    blocks: Dict[Tuple[str, str], BlockCurves]  # (block shape key, dtype) -> curves
    elementwise_bytes: np.ndarray
    elementwise_times_s: np.ndarray
    optimizer_s_per_param: float

    @classmethod
    def of(cls, level: ComputeLevel) -> Level:
        opt = [o.step_s / o.params for o in level.optimizer if o.params > 0]
        return cls(ranks=level.ranks, threads=level.threads,
                   gemm={g.dtype: GemmCurves.of(g) for g in level.gemm},
                   blocks={(b.shape, b.dtype): BlockCurves.of(b) for b in level.blocks},
                   elementwise_bytes=np.array(level.elementwise.bytes, float),
                   elementwise_times_s=np.array(level.elementwise.s, float),
                   optimizer_s_per_param=float(np.median(opt)) if opt else 0.0)

    def elementwise_s(self, nbytes: np.ndarray) -> np.ndarray:
        return loglog(nbytes, self.elementwise_bytes, self.elementwise_times_s)

    @property
    def elementwise_bytes_per_s(self) -> float:
        return float(self.elementwise_bytes[-1] / self.elementwise_times_s[-1])

    @property
    def op_overhead_s(self) -> float:
        return float(self.elementwise_times_s[0])


@dataclass(frozen=True)
class Measured:
    """Everything a profile measured, as the cost model asks for it."""

    source: str  # "profile of HOST, WHEN": what --explain prints beside a measured term
    levels: Tuple[Level, ...]
    one_host: bool  # every profiled rank shared one host's cores (a CPU, or emulated nodes)
    comms: Dict[Tuple[str, str], Dict[int, Dict[int, Tuple[np.ndarray, np.ndarray]]]] = \
        field(default_factory=dict)  # (kind, span) -> group -> ranks busy -> (bytes, s)
    fixed_bytes: float = 0.0  # memory a process holds before any model
    # engine probes by block shape: (kind, degree, ranks busy) -> layers -> micro-batch ->
    # (tokens, s, reference s: the block timed beside the probe, optimizer step s; 0: not)
    probes: Dict[str, Dict[ProbeKey, Dict[int, Dict[int, ProbeRow]]]] = \
        field(default_factory=dict)
    probe_dtype: Dict[str, str] = field(default_factory=dict)  # by block shape
    cores: int = 1  # of the host the profile ran on
    cache: Dict[Tuple[str, str], object] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, profile: ClusterProfile) -> Measured:
        meta = profile.measured
        comms: Dict[Tuple[str, str], Dict[int, Dict[int, Tuple[np.ndarray, np.ndarray]]]] = {}
        for c in profile.comms:
            busy = int(c.ranks or meta.world)
            comms.setdefault((c.kind, c.span), {}).setdefault(int(c.group), {})[busy] = (
                np.array(c.bytes, float), np.array(c.s, float))
        probes: Dict[str, Dict[ProbeKey, Dict[int, Dict[int, ProbeRow]]]] = {}
        for table in profile.probes:
            mine = probes.setdefault(table.shape, {})
            busy = table.busy or table.degree  # a profile before busy probes: the degree alone
            ref = table.ref_s or [0.0] * len(table.kind)  # ... before the reference: none
            opt = table.opt_s or [0.0] * len(table.kind)  # ... before the optimizer's: none
            for kind, degree, b, layers, mb, tok, s, r, o in zip(
                    table.kind, table.degree, busy, table.layers, table.micro_batch,
                    table.tokens, table.step_s, ref, opt):
                mine.setdefault((kind, int(degree), int(b)), {}).setdefault(
                    int(layers), {})[int(mb)] = (float(tok), float(s), float(r), float(o))
        return cls(source=f"profile of {meta.host}, {meta.when}",
                   levels=tuple(sorted((Level.of(lv) for lv in profile.compute),
                                       key=lambda lv: lv.ranks)),
                   one_host=meta.hosts == 1 and meta.device_type == "cpu", comms=comms,
                   fixed_bytes=profile.memory.baseline_bytes, probes=probes,
                   probe_dtype={t.shape: t.dtype for t in profile.probes if t.dtype},
                   cores=max(1, int(meta.cores_per_host or 1)))

    def level(self, ranks_per_host: int) -> Level:
        """The level of the first measured count of busy ranks at least `ranks_per_host` (the
        largest measured when more share a host than were profiled)."""
        for lv in self.levels:
            if lv.ranks >= ranks_per_host:
                return lv
        return self.levels[-1]

    def collective_s(self, kind: str, nbytes: np.ndarray, group: np.ndarray, inter: np.ndarray,
                     busy: np.ndarray) -> np.ndarray:
        """Seconds of one `kind` moving `nbytes` per rank over `group` ranks, across nodes
        where `inter`, while `busy` ranks (the layout's) run collectives at once; 0 for a group
        of one. A kind or span that was not measured takes the other span's curves (a one-node
        profile prices an inter-node group at its intra-node speed; --explain says which)."""
        nbytes, group, inter, busy = np.broadcast_arrays(
            np.asarray(nbytes, float), np.asarray(group, float), np.asarray(inter, bool),
            np.asarray(busy, float))
        out = np.zeros(nbytes.shape)
        for span in ("intra", "inter"):
            curves = self.comms.get((kind, span)) or self.comms.get(
                (kind, "intra" if span == "inter" else "inter")) or {}
            mine = inter == (span == "inter")
            for g, b in set(zip(group[mine & (group > 1)].tolist(),
                                busy[mine & (group > 1)].tolist())):
                rows = (group == g) & (busy == b) & mine
                near = min(curves, key=lambda m: abs(np.log2(m) - np.log2(g)))
                by_busy = curves[near]
                xs, ys = by_busy[min(by_busy, key=lambda r: abs(np.log2(r) - np.log2(b)))]
                ring = ((g - 1) / g) / ((near - 1) / near) if kind != "p2p" else 1.0
                out[rows] = loglog(nbytes[rows], xs, ys) * ring
        return out

    def has(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.comms)

    def levels_of(self, world: np.ndarray, gpus_per_node: int
                  ) -> List[Tuple[np.ndarray, Level]]:
        """Each layout row's compute level: the ranks of a layout that share a host (all of them
        when the profiled nodes shared one host's cores, else a node's worth), as (rows, level)."""
        world = np.asarray(world, float)
        per_host = world if self.one_host else np.minimum(world, gpus_per_node)
        out = []
        for ranks in sorted(set(per_host.ravel().tolist())):
            out.append((per_host == ranks, self.level(int(ranks))))
        return out
