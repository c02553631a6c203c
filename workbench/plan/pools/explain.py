"""`python -m workbench.plan --explain KEY [--stages TEXT]` on a mixed cluster: one pipeline over
pools, stage by stage, for a placement the ranking printed or for any layout a user ran.

KEY is a key the pool ranking printed (tp, dp, micro-batch, recompute, SP; its best-ranked
placement unless `--stages` names one), a layout key as runs record it (`dpr4_dps1_tp2_...`),
or `layout`: the config's own layout group (layout.tp, dp_replicate, dp_shard, cp, recompute,
stage_layers, train.micro_batch), so the overrides a run was started with price it. `--stages`
says which pools hold each stage, mixed stages included (workbench.plan.pools.placement; for a
layout without it, launcher.stage_pools); layer counts come from it, else from
layout.stage_layers, else the even split (a layout) or the planner's split (a ranking key).

A user who sees one stage run out of memory, or one pool set the pace, needs each stage apart:
per member pool its memory by part against its GPUs' HBM, and its seconds per micro-batch; then
how the step adds up. Every number comes from the same stage matrices the ranking scores
(pipeline.build via search.price), so a placement the ranking holds explains to its figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.errors import ConfigError
from workbench.layout import RECOMPUTE, Layout, resolve
from workbench.plan.cost.columns import Schedule, columns, split_problem
from workbench.plan.cost.hardware import GIB
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.pools.cluster import pool_links
from workbench.plan.pools.pipeline import LinkArrays
from workbench.plan.pools.placement import Members, Placement, StagePlace, parse_placement
from workbench.plan.pools.search import (
    KEY,
    HeteroRanking,
    Priced,
    base_key,
    price,
    rank_pools,
    reasons,
)
from workbench.plan.search.rules import engine_only, validate_layout


@dataclass(frozen=True)
class MemberLine:
    """One pool's replicas of a stage: memory per GPU by part (bytes), the GPUs' HBM, seconds."""

    pool: str
    replicas: int
    memory_bytes: dict[str, float]
    hbm_bytes: float
    layers_s: float  # its layers, per micro-batch (forward, backward, recompute, TP, CP)
    other_s: float  # the head and loss on the last stage, and the stage's transfers
    tail_s: float  # its data-parallel collectives and optimizer step, once a step

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory_bytes.values())


@dataclass(frozen=True)
class StageLine:
    """One pipeline stage: its layers and member pools; it steps at its slowest member's pace."""

    layers: int
    members: list[MemberLine]

    @property
    def time_s(self) -> float:
        return max(m.layers_s + m.other_s for m in self.members)

    @property
    def tail_s(self) -> float:
        return max(m.tail_s for m in self.members)


@dataclass(frozen=True)
class PoolExplanation:
    key: str
    stages_text: str
    gpus: int
    rank: int  # in the ranking, best first; 0 when the ranking does not hold it
    reason: str  # why it is infeasible ("" when it is not)
    split_from: str  # where the layer counts came from
    margin_bytes: float
    stages: list[StageLine]
    micro_batches: int
    pipeline_s: float  # fill, steady state and drain of the 1F1B schedule
    tail_s: float
    step_time_s: float
    others: list[tuple[int, str]]  # (rank or 0, stages) of the key's placements in the ranking


@dataclass(frozen=True)
class _Ask:
    """What is asked about: the base degrees (a one-row column set), the placement, the layers."""

    base: dict[str, np.ndarray]
    placement: Placement
    layers: tuple[int, ...] | None
    split_from: str


def _layout(key: str, train: TrainConfig, model: ModelConfig, layout_cfg: Any,
            world: int) -> Layout:
    """The Layout `key` names: `layout` (the config's layout group) or a layout key."""
    if key == "layout":
        lay = resolve(layout_cfg, train, world)
    else:
        try:
            lay = Layout.from_key(key)
        except (TypeError, ValueError) as e:
            raise ConfigError("--explain", key, f"a layout key as runs record it ({e})") from None
    if lay.virtual_stages != 1 or (lay.pp > 1 and lay.pp_schedule != "1f1b"):
        raise ConfigError("layout.pp_schedule", lay.pp_schedule,
                          "1f1b without virtual stages (the schedule priced over pools)")
    if lay.global_batch != train.global_batch:
        raise ConfigError("--explain", key, f"a layout of train.global_batch="
                                            f"{train.global_batch}; this one's dp x mb x ga is "
                                            f"{lay.global_batch}")
    try:
        validate_layout(lay, model, lay.world_size)
    except ConfigError as e:
        if not engine_only(e):  # a rule of the cost, not only of this repository's engine
            raise
    return lay


def _ask(r: HeteroRanking, model: ModelConfig, train: TrainConfig, key: str, stages: str,
         layout_cfg: Any, stage_pools: Sequence[str]) -> _Ask:
    """Resolve KEY and --stages into degrees, a placement and (maybe) layer counts."""
    names = [p.name for p in r.pools]
    m = KEY.fullmatch(key)
    if m is None and (key == "layout" or key.startswith("dpr")):
        lay = _layout(key, train, model, layout_cfg, sum(p.gpus for p in r.pools))
        base = columns(dpr=lay.dp_replicate, dps=lay.dp_shard, tp=lay.tp, pp=1, cp=lay.cp,
                       sp=int(lay.sequence_parallel), mb=lay.micro_batch,
                       rc=RECOMPUTE.index(lay.recompute), sched=Schedule.ONE_F_ONE_B, v=1,
                       ga=lay.grad_accum)
        if stages:
            where = parse_placement(stages, names, lay.dp_replicate)
        elif stage_pools:
            if any(str(p) not in names for p in stage_pools):
                raise ConfigError("launcher.stage_pools", list(stage_pools),
                                  f"pools of the cluster: {', '.join(names)}")
            where = Placement(tuple(StagePlace(((str(p), lay.dp_replicate),))
                                    for p in stage_pools))
        else:
            raise ConfigError("--stages", "", f"which pools hold each stage, e.g. "
                                              f"\"{' | '.join(names)}\" (or launcher.stage_pools)")
        if lay.pp != len(where.stages):
            raise ConfigError("--stages", stages or list(stage_pools),
                              f"one entry per pipeline stage: layout.pp={lay.pp}")
        own = where.layers
        if own and lay.stage_layers and own != lay.stage_layers:
            raise ConfigError("--stages", stages, f"layer counts {list(own)} differ from "
                                                  f"layout.stage_layers={list(lay.stage_layers)}")
        layers = own or lay.stage_split(model.n_layers)
        src = "--stages" if own else "layout.stage_layers" if lay.stage_layers else \
            "the even split (layout.stage_layers empty)"
        return _Ask(base, where, layers, src)
    if m is None:
        example = r.key(int(r.order[0])) if len(r.order) else r.key(0)
        raise ConfigError("--explain", key, f"a layout key as the pool ranking prints it (e.g. "
                                            f"{example}), one as runs record it, or `layout`")
    tp, cp, dpr, dps, mb = (int(g or 1) for g in m.groups()[:5])
    recompute = (m.group(7) or "none").replace("-", "_")
    if min(tp, cp, dpr, dps, mb) < 1 or train.global_batch % (dpr * dps * mb) or \
            recompute not in RECOMPUTE:
        raise ConfigError("--explain", key, f"degrees >= 1, recompute one of {RECOMPUTE} and a "
                                            f"layout of train.global_batch={train.global_batch} "
                                            "(a multiple of dp x mb)")
    rc = RECOMPUTE.index(recompute)
    base = columns(dpr=dpr, dps=dps, tp=tp, pp=1, cp=cp, sp=int(bool(m.group(6))), mb=mb, rc=rc,
                   sched=Schedule.ONE_F_ONE_B, v=1, ga=train.global_batch / (dpr * dps * mb))
    if stages:
        where = parse_placement(stages, names, dpr)
        return _Ask(base, where, where.layers, "--stages" if where.layers else
                    "the planner's split for this placement")
    rows = _ranked_rows(r, key)
    if not rows:
        raise ConfigError("--explain", key, "a key the pool ranking prints (or give --stages)")
    best = r.placement(rows[0])
    return _Ask(base, best, best.layers, "the planner's split")


def _ranked_rows(r: HeteroRanking, key: str) -> list[int]:
    """The ranking's placements of `key`, best-ranked first (infeasible ones last)."""
    rank_of = {int(i): k for k, i in enumerate(r.order)}
    return sorted((i for i in range(len(r)) if r.key(i) == key),
                  key=lambda i: rank_of.get(i, math.inf))


def explain_pools(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, key: str,
                  stages: str = "", lowrank: LowRankConfig | None = None,
                  margin_bytes: float = 0.0, software: Software | None = None,
                  layout_cfg: Any = None, stage_pools: Sequence[str] = ()) -> PoolExplanation:
    """Itemize the placement KEY and `stages` name (see the module docstring)."""
    sw = software or software_for(train, cluster)
    r = rank_pools(model, cluster, train, lowrank, sw, margin_bytes)
    ask = _ask(r, model, train, key, stages, layout_cfg, stage_pools)
    n_st = len(ask.placement.stages)
    if ask.layers is not None and split_problem(ask.layers, n_st, model.n_layers):
        raise ConfigError("--stages" if ask.split_from == "--stages" else "layout.stage_layers",
                          stages if ask.split_from == "--stages" else list(ask.layers),
                          split_problem(ask.layers, n_st, model.n_layers))
    names = [p.name for p in r.pools]
    per_replica = int(ask.base["tp"][0] * ask.base["cp"][0] * ask.base["dps"][0])
    for pool in r.pools:
        used = ask.placement.replicas_on(pool.name) * per_replica
        if used > pool.gpus:
            raise ConfigError("--stages", stages or ask.placement.text(),
                              f"pool {pool.name} has {pool.gpus} GPUs; this placement puts "
                              f"{used} there ({per_replica} a replica)")
    members = Members.of([[[(names.index(p), n) for p, n in s.members]
                           for s in ask.placement.stages]])
    links = LinkArrays.of(r.pools, pool_links(cluster, r.pools))
    layers = None if ask.layers is None else np.array([ask.layers])
    p = price(model_shape(model, lowrank), r.pools, links, sw, ask.base,
              np.zeros(1, dtype=np.int64), members, layers, margin_bytes)
    text, k = p.placement(0).text(), base_key(ask.base, 0)
    rows = _ranked_rows(r, k)
    rank_of = {int(i): j + 1 for j, i in enumerate(r.order)}
    same = [i for i in rows if r.stages(i) == text]
    lines = _stage_lines(p, margin_bytes)
    ga = int(ask.base["ga"][0])
    times = [s.time_s for s in lines]
    return PoolExplanation(
        key=k, stages_text=text, gpus=p.gpus(0), rank=rank_of.get(same[0], 0) if same else 0,
        reason=reasons(model, p)[0], split_from=ask.split_from, margin_bytes=margin_bytes,
        stages=lines, micro_batches=ga, pipeline_s=sum(times) + (ga - 1) * max(times),
        tail_s=max(s.tail_s for s in lines), step_time_s=float(p.out["step_time_s"][0]),
        others=[(rank_of.get(j, 0), r.stages(j)) for j in rows if j not in same])


def _stage_lines(p: Priced, margin_bytes: float) -> list[StageLine]:
    st, n = p.detail, p.layers[0]
    out = []
    for j, s in enumerate(p.placement(0).stages):
        members = []
        for k, (pool, replicas) in enumerate(s.members):
            mem = {name: float(n[j]) * float(v[0, j, k]) for name, v in st.u_parts.items()}
            mem.update({name: float(v[0, j, k]) for name, v in st.w_parts.items()})
            members.append(MemberLine(
                pool=pool, replicas=replicas, memory_bytes=mem,
                hbm_bytes=float(st.hbm[0, j, k]) + margin_bytes,
                layers_s=float(n[j]) * float(st.c[0, j, k]), other_s=float(st.e[0, j, k]),
                tail_s=float(n[j]) * float(st.q[0, j, k]) + float(st.r[0, j, k])))
        out.append(StageLine(layers=int(n[j]), members=members))
    return out


def render_pools(x: PoolExplanation, stack: str = "") -> list[str]:
    """The lines `--explain` prints on a mixed cluster: per stage a column per member pool."""
    where = (f"infeasible: {x.reason}" if x.reason else f"rank {x.rank}" if x.rank else
             "feasible; not a placement the ranking holds")
    out = [f"layout {x.key} on {x.stages_text}  ({x.gpus} GPUs{', stack ' + stack if stack else ''}"
           f", {where})", f"layers per stage: {x.split_from}"]
    margin = x.margin_bytes / GIB
    for k, s in enumerate(x.stages):
        head = "+".join(f"{m.pool} x{m.replicas}" for m in s.members)
        pace = "; its replicas step at the slowest one's pace" if len(s.members) > 1 else ""
        out.append(f"stage {k}: {s.layers} layers on {head}{pace}")
        cols = "".join(f"{m.pool:>12}" for m in s.members)
        out.append(f"  {'memory per GPU, GiB':<44}{cols}")
        for label in s.members[0].memory_bytes:
            vals = [m.memory_bytes[label] for m in s.members]
            if any(vals):
                out.append(f"  {label:<44}" + "".join(f"{v / GIB:>12.2f}" for v in vals))
        out.append(f"  {'total':<44}" + "".join(f"{m.peak_bytes / GIB:>12.2f}" for m in s.members))
        room = [m.hbm_bytes - x.margin_bytes - m.peak_bytes for m in s.members]
        out.append(f"  {f'HBM less the {margin:g} GiB margin':<44}" + "".join(
            f"{(m.hbm_bytes - x.margin_bytes) / GIB:>12.2f}" for m in s.members)
            + ("  fits" if min(room) >= 0 else "  does NOT fit"))
        out.append(f"  {'per micro-batch s: layers':<44}"
                   + "".join(f"{m.layers_s:>12.4f}" for m in s.members))
        out.append(f"  {'  head, loss and transfers':<44}"
                   + "".join(f"{m.other_s:>12.4f}" for m in s.members))
        out.append(f"  {'all-reduce and optimizer s, once a step':<44}"
                   + "".join(f"{m.tail_s:>12.4f}" for m in s.members))
    slow = max(range(len(x.stages)), key=lambda k: x.stages[k].time_s)
    out.append(f"step: 1F1B over {x.micro_batches} micro-batches {x.pipeline_s:.4f} s (every "
               f"stage once to fill and drain, then {x.micro_batches - 1} x stage {slow}) + "
               f"the slowest all-reduce and optimizer {x.tail_s:.4f} s = {x.step_time_s:.4f} s")
    for rank, text in x.others[:5]:
        out.append(f"also {x.key}: {text}  ({f'rank {rank}' if rank else 'infeasible'}; "
                   "--stages picks it)")
    return out
