"""What the engine costs beyond the priced operations, from the profile's engine probes.

A probe is one micro-batch of the real engine for one kind of parallelism at one degree, on
models of one layer and of three (workbench/profile/probes.py). The cost model prices the same
probe from its curves; what the probe took beyond that price is the engine's own cost (Python
hooks, DTensor dispatch, FSDP2's copies, autograd's graph): per layer (half of three layers
less one) and per micro-batch (one layer less its layer), each a least-squares line in tokens
through the probed micro-batches. A layout pays the plain
probe's residuals, and for each kind of parallelism it uses the difference its kind's probe
made, at its degree (the nearest probed). On a CPU the engine's work runs on the cores the
ranks share: each degree was probed alone and again with every rank of the profile busy, and a
layout takes the probe whose count of busy ranks is nearest its own, scaled by the ratio of
oversubscription only where a layout puts more ranks on the cores than any probe did. The
engine's optimizer step after each probe step is residual the same way, per layer and per
step, beyond the optimizer the compute tables price (the plain model's update): over DTensors
its clipping and AdamW dispatch per shard. A probe's
compute is priced at the speed its reference block ran beside it (probes.py), so that a machine
slower or faster while the probes ran than while the tables were timed is not taken for the
engine's cost. No run is fitted: the probes are part of the profile, measured before any run
they price.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Tuple

import numpy as np

from workbench.layout import Layout
from workbench.plan.cost.columns import Columns, layout_columns
from workbench.plan.cost.communication import ENGINE_FORWARD_SHARE, Communication
from workbench.plan.cost.compute import Compute
from workbench.plan.cost.measured import Measured
from workbench.plan.cost.per_rank import PerRank
from workbench.plan.cost.shapes import ModelShape, block_key

Arrays = Dict[str, np.ndarray]
# A probe kind and the layout it probes (its micro-batch set per row).
PROBES: Dict[str, Callable[[int], Layout]] = {
    "plain": lambda d: Layout(), "recompute": lambda d: Layout(recompute="full"),
    "ddp": lambda d: Layout(dp_replicate=d), "fsdp": lambda d: Layout(dp_shard=d),
    "tp": lambda d: Layout(tp=d), "tp_sp": lambda d: Layout(tp=d, sequence_parallel=True),
    "cp": lambda d: Layout(cp=d),
    # composed: replication (or sharding) over 2 next to another kind over the rest
    "ddp_tp": lambda d: Layout(dp_replicate=2, tp=d // 2),
    "fsdp_tp": lambda d: Layout(dp_shard=2, tp=d // 2),
    "ddp_cp": lambda d: Layout(dp_replicate=2, cp=d // 2),
    "hsdp": lambda d: Layout(dp_replicate=2, dp_shard=d // 2)}
COMPOSED = ("ddp_tp", "fsdp_tp", "ddp_cp", "hsdp")
# The priced parts of a probe's micro-batch: all a train_step runs (no optimizer, no bubble).
STEP_PARTS = ("time_fwd_s", "time_bwd_s", "time_recompute_s", "time_tp_comm_s",
              "time_cp_comm_s", "time_pp_p2p_s", "time_dp_comm_exposed_s")
COMPUTE_PARTS = ("time_fwd_s", "time_bwd_s", "time_recompute_s")
TABLES = ("layer", "micro_batch", "opt_layer", "opt_step")  # Residuals' curves
Curve = Tuple[np.ndarray, np.ndarray]
Key = Tuple[str, int, int]  # kind, degree, ranks busy while it was probed


def _nearest(values: list, target: float) -> int:
    """The value nearest `target` on a log scale (the larger on a tie)."""
    return min(sorted(values, reverse=True),
               key=lambda p: abs(np.log2(p) - np.log2(max(target, 1.0))))


@dataclass(frozen=True)
class Residuals:
    """Per (kind, degree, ranks busy): the engine's own seconds per layer and per micro-batch,
    over the probe's tokens per rank, and its optimizer step's per layer and per step (flat
    in tokens); and the cores of the host the probes ran on."""

    layer: Dict[Key, Curve]
    micro_batch: Dict[Key, Curve]
    cores: int
    opt_layer: Dict[Key, Curve] = field(default_factory=dict)
    opt_step: Dict[Key, Curve] = field(default_factory=dict)

    def at(self, table: str, kind: str, degree: np.ndarray, tokens: np.ndarray,
           busy: np.ndarray) -> np.ndarray:
        """A residual per row, at the nearest probed degree of `kind` and, of its probes, the
        one with the nearest count of busy ranks, scaled by how much more (or less) a row's
        `busy` ranks oversubscribe the cores than the probe's did (0 where none)."""
        curves = getattr(self, table)
        out = np.zeros(len(tokens))
        degrees = {d for k, d, _ in curves if k == kind}
        if not degrees:
            return out
        degree, busy = np.broadcast_arrays(np.asarray(degree, float), np.asarray(busy, float))
        for d, b in set(zip(degree.tolist(), busy.tolist())):
            near = _nearest(list(degrees), d)
            probed = _nearest([p for k, g, p in curves if k == kind and g == near], b)
            toks, secs = curves[(kind, near, probed)]
            rows = (degree == d) & (busy == b)
            # on the line, and past the probed tokens along it
            slope = (secs[-1] - secs[0]) / (toks[-1] - toks[0]) if len(toks) > 1 else 0.0
            out[rows] = (secs[0] + slope * (tokens[rows] - toks[0])) \
                * max(1.0, b / self.cores) / max(1.0, probed / self.cores)
        return out


Price = Callable[[ModelShape, Columns, "Residuals | None"], Arrays]


def residuals(measured: Measured, shape: ModelShape, price: Price) -> Residuals | None:
    """The residuals of the probes of `shape`'s block (None when it was not probed), priced
    by `price` (the cost model without residuals, or with the single kinds' residuals given);
    computed once per profile and shape. A composed probe's residual is what it took beyond
    its price with the residuals of its single kinds in it: what composing them adds."""
    key = block_key(shape)
    rows = measured.probes.get(key)
    if rows is None:
        return None
    cached = measured.cache.get(("residuals", key))
    if cached is not None:
        return cached
    tables: Dict[str, Dict[Key, Curve]] = {t: {} for t in TABLES}
    for composed in (False, True):
        single = Residuals(**{t: dict(v) for t, v in tables.items()}, cores=measured.cores) \
            if composed else None
        for (kind, degree, busy), by_layers in rows.items():
            if kind not in PROBES or set(by_layers) != {1, 3} or (kind in COMPOSED) != composed:
                continue
            speed = _speed(measured, shape, kind, degree, busy, by_layers)
            lines = _probe_residual(shape, kind, degree, busy, by_layers, speed,
                                    lambda s, c, r=single: price(s, c, r))
            for table, line in lines.items():
                tables[table][(kind, degree, busy)] = line
    out = Residuals(**tables, cores=measured.cores)
    measured.cache[("residuals", key)] = out
    return out


def _speed(measured: Measured, shape: ModelShape, kind: str, degree: int, busy: int,
           by_layers: dict) -> Dict[int, float]:
    """Per micro-batch, how much longer the reference block took beside the probe's steps than
    the compute table's same block (1 where the profile has no reference): the machine's speed
    while the probe ran, against its speed while the tables were timed."""
    key, dtype = block_key(shape), measured.probe_dtype.get(block_key(shape), "")
    block = measured.level(busy).blocks.get((key, dtype))
    out = {}
    for mb, (tokens, _, ref_s, _) in by_layers[1].items():
        parts = [block.seconds(p, np.array([tokens]), np.array([float(PROBES[kind](degree).tp)]))
                 for p in (1, 2)] if block is not None and ref_s > 0 else [None]
        out[mb] = 1.0 if any(p is None for p in parts) else ref_s / float(sum(parts)[0])
    return out


def _probe_residual(shape: ModelShape, kind: str, degree: int, busy: int, by_layers: dict,
                    speed: Dict[int, float], price: Callable[[ModelShape, Columns], Arrays]
                    ) -> Dict[str, Curve]:
    """One probe's residual lines by table (TABLES): its time beyond its price, the price's
    compute at the speed its reference measured (`speed`, per micro-batch), per layer and per
    micro-batch; its optimizer step's beyond the priced one (where measured), per layer and
    per step, the median over the micro-batches (an update does not see the tokens)."""
    mbs = sorted(set(by_layers[1]) & set(by_layers[3]))
    cols = layout_columns([replace(PROBES[kind](degree), micro_batch=mb) for mb in mbs])
    cols["busy"] = np.full(len(mbs), float(busy))  # priced as it ran: beside the others
    at = np.array([speed.get(mb, 1.0) for mb in mbs])
    terms = {n: price(replace(shape, n_layers=n), cols) for n in (1, 3)}
    tokens = np.array([by_layers[1][mb][0] for mb in mbs], float)
    out = {}
    for table, column, priced in (("", 1, {n: _step(t, at) for n, t in terms.items()}),
                                  ("opt_", 3, {n: t["time_optimizer_s"]
                                               for n, t in terms.items()})):
        measured = {n: np.array([by_layers[n][mb][column] for mb in mbs]) for n in (1, 3)}
        if not (measured[1] > 0).all():
            continue  # a profile before the optimizer's timing
        one_layer = ((measured[3] - measured[1]) - (priced[3] - priced[1])) / 2
        rest = measured[1] - priced[1] - one_layer
        if table:  # flat in tokens
            one_layer, rest = (np.full(len(mbs), np.median(x)) for x in (one_layer, rest))
        out[f"{table}layer"] = _line(tokens, one_layer)
        out["opt_step" if table else "micro_batch"] = _line(tokens, rest)
    return out


def _line(tokens: np.ndarray, seconds: np.ndarray) -> Curve:
    """The least-squares line through the probed micro-batches, as its values there: what the
    engine adds is partly per call (hooks, dispatch) and partly per byte (copies around its
    collectives), and a line through three probes is steadier than any one of them."""
    if len(tokens) < 2:
        return tokens, seconds
    slope, intercept = np.polyfit(tokens, seconds, 1)
    return tokens, intercept + slope * tokens


def _step(terms: Arrays, speed: np.ndarray | float = 1.0) -> np.ndarray:
    """A probe's priced micro-batch, its compute slowed by `speed`."""
    return sum(terms[k] * (speed if k in COMPUTE_PARTS else 1.0) for k in STEP_PARTS)


def row_residuals(res: Residuals, rank: PerRank, world: np.ndarray) -> Arrays:
    """Each row's residuals, by the term they belong to: per layer and micro-batch `layer`
    (the plain probe's, on the layer's compute), `recompute`, `tp`, `cp`; per micro-batch
    `micro_batch`; the data-parallel kinds' per layer `fsdp` (each micro-batch) and `ddp`
    (once a step); and the optimizer step's per layer `opt_layer` and per step `opt_step` (the
    plain probe's, and each kind's difference from it, as the micro-batch's)."""
    cols, tokens = rank.cols, rank.tokens
    one = np.ones(len(tokens))
    busy = np.asarray(world, float)  # ranks sharing the cores in the layout priced

    def delta(table: str, kind: str, degree: np.ndarray, on: np.ndarray) -> np.ndarray:
        own = res.at(table, kind, degree, tokens, busy)
        base = res.at(table, "plain", one, tokens, busy) if table == "micro_batch" else 0.0
        return np.where(on, own - base, 0.0)

    tp_kind = np.where(cols["sp"] > 0, 1, 0)
    # A layer of one rank is the measured block itself: the plain probe's per-layer residual
    # is the machine's drift between the two measurements, not the engine's, and is left out.
    out = {"layer": np.zeros(len(tokens)),
           "micro_batch": res.at("micro_batch", "plain", one, tokens, busy),
           "recompute": delta("layer", "recompute", one, rank.full_share > 0) * rank.full_share}
    for name, kind, degree in (("tp", "tp", cols["tp"]), ("cp", "cp", cols["cp"]),
                               ("fsdp", "fsdp", cols["dps"]),
                               ("ddp", "ddp", rank.reduce_ranks)):
        on = degree > 1
        if name == "tp":
            out[name] = np.where(tp_kind > 0, delta("layer", "tp_sp", degree, on),
                                 delta("layer", "tp", degree, on))
        else:
            out[name] = delta("layer", kind, degree, on)
    for kind in ("tp", "cp", "fsdp"):  # their per-micro-batch differences, once per micro-batch
        degree = cols[kind] if kind != "fsdp" else cols["dps"]
        out["micro_batch"] = out["micro_batch"] + delta("micro_batch", kind, degree, degree > 1)
    out.update(_optimizer(res, rank, busy, tp_kind))
    # what composing two kinds adds (FSDP2 over the other kind's DTensors), per layer on the
    # data-parallel term and per micro-batch, where a composed probe measured it
    degree = cols["dpr"] * cols["dps"] * cols["tp"] * cols["cp"]
    for kind, on in composed_rows(cols).items():
        if on.any():
            for name, table in (("fsdp", "layer"), ("micro_batch", "micro_batch"),
                                ("opt_layer", "opt_layer"), ("opt_step", "opt_step")):
                out[name] = out[name] + np.where(on, res.at(table, kind, degree, tokens, busy),
                                                 0.0)
    return out


def _optimizer(res: Residuals, rank: PerRank, busy: np.ndarray, tp_kind: np.ndarray
               ) -> Arrays:
    """The optimizer step's residuals per layer and per step: the plain probe's, and for each
    kind a layout uses, the difference its probe made at its degree."""
    cols, tokens = rank.cols, rank.tokens
    one = np.ones(len(tokens))
    out = {}
    for table in ("opt_layer", "opt_step"):
        base = res.at(table, "plain", one, tokens, busy)
        total = base.copy()
        for kind, degree in (("tp", cols["tp"]), ("cp", cols["cp"]),
                             ("fsdp", cols["dps"]), ("ddp", rank.reduce_ranks)):
            own = res.at(table, kind, degree, tokens, busy)
            if kind == "tp":
                own = np.where(tp_kind > 0, res.at(table, "tp_sp", degree, tokens, busy), own)
            total = total + np.where(degree > 1, own - base, 0.0)
        out[table] = total
    return out


def composed_rows(cols: Columns) -> Dict[str, np.ndarray]:
    """Which rows each composed probe prices: exactly its two kinds, outside a pipeline (a
    stage's data-parallel engine runs once a step there, and no probe composes a pipeline)."""
    dpr, dps, tp, cp = (cols[k] > 1 for k in ("dpr", "dps", "tp", "cp"))
    flat = cols["pp"] == 1
    return {"ddp_tp": flat & dpr & tp & ~dps & ~cp, "fsdp_tp": flat & dps & tp & ~dpr & ~cp,
            "ddp_cp": flat & dpr & cp & ~dps & ~tp, "hsdp": flat & dpr & dps & ~tp & ~cp}


def with_residuals(comp: Compute, comm: Communication, extra: Arrays
                   ) -> tuple[Compute, Communication]:
    """The terms with the engine's residuals in them: the plain per-layer one on the layer's
    compute (a third forward, two thirds backward, as autograd's work falls), recomputation's
    on the backward that redoes it, the per-micro-batch one beside the head and loss, tensor
    and context parallelism's on their own terms."""
    ends_bwd = comp.ends_bwd_s if comp.ends_bwd_s is not None else 2 * (comp.head_s + comp.loss_s)
    fwd = ENGINE_FORWARD_SHARE
    comp = replace(comp, layer_fwd_s=comp.layer_fwd_s + extra["layer"] * fwd,
                   layer_bwd_s=comp.layer_bwd_s + extra["layer"] * (1 - fwd)
                   + extra["recompute"],
                   head_s=comp.head_s + extra["micro_batch"] * fwd,
                   ends_bwd_s=ends_bwd + extra["micro_batch"] * (1 - fwd))
    return comp, replace(comm, tp_engine_s=extra["tp"], cp_engine_s=extra["cp"])
