"""`python -m workbench.plan --explain KEY [--stages TEXT]` on a mixed cluster: one pipeline over
pools, stage by stage.

The pool ranking places a base layout (tp, dp, micro-batch, recompute, SP: its KEY) on an ordered
selection of pools with a layer split, so several placements share a key. A user who sees one
stage run out of memory, or one pool set the pace, needs each stage apart: its pool, layers,
memory by part against that pool's HBM, and seconds per micro-batch, then how the step adds up
(1F1B fill and drain, the slowest stage's steady state, its all-reduce and optimizer). Every
number is read from the ranking's own stage matrices (hetero.build), so they sum to what it
printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.errors import ConfigError
from workbench.plan.cost.hardware import GIB
from workbench.plan.pools.search import HeteroRanking, rank_pools, world_of


@dataclass(frozen=True)
class StageLine:
    """One pipeline stage: memory by part (bytes), its GPUs' HBM, its time per micro-batch."""

    pool: str
    layers: int
    memory_bytes: dict[str, float]
    hbm_bytes: float
    layers_s: float  # its layers, per micro-batch (forward, backward, recompute, TP)
    other_s: float  # the head and loss on the last stage, and the stage's transfers
    tail_s: float  # its data-parallel all-reduce and optimizer step, once a step

    @property
    def peak_bytes(self) -> float:
        return sum(self.memory_bytes.values())


@dataclass(frozen=True)
class PoolExplanation:
    key: str
    stages_text: str
    gpus: int
    rank: int  # in the ranking, best first; 0 when the placement is infeasible
    reason: str  # why it is infeasible ("" when it is not)
    margin_bytes: float
    stages: list[StageLine]
    micro_batches: int
    pipeline_s: float  # fill, steady state and drain of the 1F1B schedule
    tail_s: float
    step_time_s: float
    others: list[tuple[int, str]]  # (rank or 0, stages) of the key's other placements


def _squash(text: str) -> str:
    return "".join(text.split())


def explain_pools(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, key: str,
                  stages: str = "", lowrank: LowRankConfig | None = None,
                  margin_bytes: float = 0.0) -> PoolExplanation:
    """Itemize the placement of `key` that `stages` names (as the ranking prints it), else the
    key's best-ranked placement."""
    r = rank_pools(model, cluster, train, lowrank, margin_bytes=margin_bytes)
    rows = [i for i in range(len(r)) if r.key(i) == key]
    if not rows:
        example = r.key(int(r.order[0])) if len(r.order) else r.key(0)
        raise ConfigError("--explain", key, f"a layout key as the pool ranking prints it "
                                            f"(e.g. {example})")
    rank_of = {int(i): k + 1 for k, i in enumerate(r.order)}
    rows.sort(key=lambda i: rank_of.get(i, math.inf))
    if stages:
        named = [i for i in rows if _squash(r.stages(i)) == _squash(stages)]
        if not named:
            raise ConfigError("--stages", stages, f"a placement of {key} as the ranking prints "
                                                  f"it, e.g. {r.stages(rows[0])}")
        rows.remove(named[0])
        rows.insert(0, named[0])
    i = rows[0]
    lines = _stage_lines(r, i, margin_bytes)
    ga = int(r.base["ga"][r.base_idx[i]])
    per_mb = [s.layers_s + s.other_s for s in lines]
    pipeline_s = sum(per_mb) + (ga - 1) * max(per_mb)
    return PoolExplanation(
        key=key, stages_text=r.stages(i), gpus=world_of(r, i), rank=rank_of.get(i, 0),
        reason=r.reason[i], margin_bytes=margin_bytes, stages=lines, micro_batches=ga,
        pipeline_s=pipeline_s, tail_s=max(s.tail_s for s in lines),
        step_time_s=float(r.step_time_s[i]),
        others=[(rank_of.get(j, 0), r.stages(j)) for j in rows[1:]])


def _stage_lines(r: HeteroRanking, i: int, margin_bytes: float) -> list[StageLine]:
    st = r.detail
    out = []
    for j in range(st.on.shape[1]):
        if not st.on[i, j]:
            continue
        n = float(r.layers[i, j])
        mem = {k: n * float(v[i, j]) for k, v in st.u_parts.items()}
        mem.update({k: float(v[i, j]) for k, v in st.w_parts.items()})
        out.append(StageLine(pool=r.pools[int(r.stage_pool[i, j])].name, layers=int(n),
                             memory_bytes=mem, hbm_bytes=float(st.hbm[i, j]) + margin_bytes,
                             layers_s=n * float(st.c[i, j]), other_s=float(st.e[i, j]),
                             tail_s=n * float(st.q[i, j]) + float(st.r[i, j])))
    return out


def render_pools(x: PoolExplanation) -> list[str]:
    """The lines `--explain` prints on a mixed cluster."""
    where = f"rank {x.rank}" if x.rank else f"infeasible: {x.reason}"
    out = [f"layout {x.key} on {x.stages_text}  ({x.gpus} GPUs, {where})"]
    margin = x.margin_bytes / GIB
    for k, s in enumerate(x.stages):
        out.append(f"stage {k}: {s.pool}, {s.layers} layers")
        out += [f"  {label:<44}{b / GIB:>9.2f} GiB" for label, b in s.memory_bytes.items()]
        room = s.hbm_bytes - x.margin_bytes - s.peak_bytes
        verdict = "fits" if room >= 0 else "does NOT fit"
        out.append(f"  {'total':<44}{s.peak_bytes / GIB:>9.2f} GiB: {verdict} in "
                   f"{s.hbm_bytes / GIB:.1f} GiB with a {margin:g} GiB margin "
                   f"(headroom {(s.hbm_bytes - s.peak_bytes) / GIB:.2f} GiB)")
        out.append(f"  per micro-batch {s.layers_s + s.other_s:.4f} s: layers "
                   f"{s.layers_s:.4f} s + head, loss and transfers {s.other_s:.4f} s; "
                   f"all-reduce and optimizer {s.tail_s:.4f} s a step")
    slow = max(range(len(x.stages)), key=lambda k: x.stages[k].layers_s + x.stages[k].other_s)
    out.append(f"step: 1F1B over {x.micro_batches} micro-batches {x.pipeline_s:.4f} s (every "
               f"stage once to fill and drain, then {x.micro_batches - 1} x stage {slow}) + "
               f"the slowest all-reduce and optimizer {x.tail_s:.4f} s = {x.step_time_s:.4f} s")
    for rank, text in x.others[:5]:
        out.append(f"also {x.key}: {text}  ({f'rank {rank}' if rank else 'infeasible'}; "
                   "--stages picks it)")
    return out
