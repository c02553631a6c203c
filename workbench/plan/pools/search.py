"""Layout search over pools: which pools, in which pipeline order, and every layout on them.

The space: every ordered choice of pools (one pool alone answers "is the fast pool enough?"),
crossed with tensor-parallel degree tp (inside a node of every chosen pool), one data-parallel
degree dp for every stage (what the engine runs), micro-batch, recompute and sequence parallel.
A chosen pool is used whole: it holds G / (tp dp) consecutive pipeline stages of tp x dp GPUs
each, so a stage never spans two GPU types. Every layout gets its own layer split
(workbench.plan.hetero.balance) and is checked by the cost rules every planner path shares
(workbench.plan.rules), as a pipeline of all its stages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import format_split
from workbench.plan.cost.columns import RECOMPUTE, Recompute, Schedule, columns
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.pools.cluster import Pool, pool_links, pools_of
from workbench.plan.pools.pipeline import (
    PoolCosts,
    Stages,
    balance,
    build,
    cross_time,
    pool_costs,
    step,
)
from workbench.plan.search.exhaustive import NOT_FIT
from workbench.plan.search.rules import COST_RULES, first_broken
from workbench.plan.search.space import MICRO_BATCHES, divisors


def arrangements(n_pools: int) -> list[tuple[int, ...]]:
    """Every ordered selection of distinct pools, singles first."""
    return [p for k in range(1, n_pools + 1) for p in itertools.permutations(range(n_pools), k)]


def base_space(pools: list[Pool], gb: int) -> dict[str, np.ndarray]:
    """(tp, dp, mb, rc, sp) rows any arrangement may use, as pipeline-free columns."""
    tps = sorted({d for p in pools for d in divisors(p.spec.gpus_per_node)})
    dps = sorted({d for p in pools for d in divisors(p.gpus)})
    rows = [(dp, tp, mb, rc, sp) for tp, dp, mb, rc, sp in itertools.product(
        tps, dps, MICRO_BATCHES, Recompute, (0, 1)) if gb % (dp * mb) == 0 and (sp == 0 or tp > 1)]
    t = np.array(rows, dtype=np.float64).T
    a = columns(dpr=t[0], dps=1, tp=t[1], pp=1, cp=1, sp=t[4], mb=t[2], rc=t[3],
                sched=Schedule.ONE_F_ONE_B, v=1)
    a["ga"] = gb / (a["dpr"] * a["mb"])
    return a


@dataclass
class HeteroRanking:
    """Every layout over the cluster's pools, scored; `order` lists the feasible, best first."""

    pools: list[Pool]
    base: dict[str, np.ndarray]
    base_idx: np.ndarray  # (N,) row of `base`
    stage_pool: np.ndarray  # (N, S) pool of each stage, -1 past the last
    layers: np.ndarray  # (N, S) layers of each stage
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mem_frac: np.ndarray  # fullest stage's memory / its GPU's
    reason: list[str]  # "" where feasible
    order: np.ndarray
    detail: Stages | None = None  # the stage matrices the scores came from (--explain)

    def __len__(self) -> int:
        return len(self.base_idx)

    def uses(self, i: int) -> tuple[str, ...]:
        """The pools of layout i in pipeline order."""
        seq = [int(p) for p in self.stage_pool[i] if p >= 0]
        return tuple(self.pools[p].name for p in dict.fromkeys(seq))

    def key(self, i: int) -> str:
        b = int(self.base_idx[i])
        a = self.base
        rc = RECOMPUTE[int(a["rc"][b])]
        return (f"tp{int(a['tp'][b])}_dp{int(a['dpr'][b])}_mb{int(a['mb'][b])}"
                f"{'_sp' if a['sp'][b] else ''}{'' if rc == 'none' else '_rc-' + rc}")

    def stages(self, i: int) -> str:
        """`h100:10x4 | a100:6-5x7`: each pool's stages with their layer counts."""
        out, seq = [], self.stage_pool[i]
        for name in self.uses(i):
            p = [j for j, q in enumerate(self.pools) if q.name == name][0]
            out.append(f"{name}:{format_split([int(x) for x in self.layers[i][seq == p]])}")
        return " | ".join(out)

    def best_single_pool(self) -> int | None:
        """The best feasible layout that uses one pool only (None if there is none)."""
        return next((int(i) for i in self.order if len(self.uses(int(i))) == 1), None)

    def rejected(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reason:
            if r:
                out[r] = out.get(r, 0) + 1
        return out


def _layouts(pools: list[Pool], base: dict[str, np.ndarray]
             ) -> tuple[np.ndarray, list[list[int]]]:
    """(base row, stage pools) of every layout: a base row on an arrangement whose pools it
    fits whole (tp inside their nodes, tp * dp dividing their GPUs)."""
    rows, seqs = [], []
    tp, dp = base["tp"].astype(int), base["dpr"].astype(int)
    for arr in arrangements(len(pools)):
        fits = np.ones(len(tp), dtype=bool)
        for p in arr:
            fits &= (pools[p].spec.gpus_per_node % tp == 0) & (pools[p].gpus % (tp * dp) == 0)
        for b in np.flatnonzero(fits):
            rows.append(b)
            seqs.append([p for p in arr for _ in range(pools[p].gpus // (tp[b] * dp[b]))])
    return np.array(rows, dtype=np.int64), seqs


def _reasons(model: ModelConfig, base: dict[str, np.ndarray], rows: np.ndarray,
             n_stages: np.ndarray) -> np.ndarray:
    """Index (1-based) of the first cost rule each layout breaks, as a pipeline of its stages
    with a given split (0: none)."""
    a = {k: v[rows] for k, v in base.items()}
    a.update(pp=n_stages.astype(float), sched=np.full(len(rows), float(Schedule.ONE_F_ONE_B)),
             lf=np.zeros(len(rows)), ll=np.zeros(len(rows)), lm=np.ones(len(rows)),
             lsum=np.full(len(rows), float(model.n_layers)))
    world = a["dpr"] * a["tp"] * a["pp"]
    return first_broken(model, world, a, COST_RULES)


def rank_pools(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
               lowrank: LowRankConfig | None = None, software: Software | None = None,
               margin_bytes: float = 0.0) -> HeteroRanking:
    """Score every layout over the cluster's pools (workbench.plan.pools.pools_of); every stage
    keeps `margin_bytes` of its GPUs' memory free (the split balances within the rest, and
    mem_frac is a share of the rest)."""
    pools = pools_of(cluster)
    gb = int(train.global_batch)
    ms = model_shape(model, lowrank)
    sw = software or software_for(train, cluster)
    base = base_space(pools, gb)
    costs: list[PoolCosts] = [replace(c, hbm_bytes=c.hbm_bytes - margin_bytes)
                              for c in (pool_costs(ms, p, sw, base) for p in pools)]
    rows, seqs = _layouts(pools, base)
    s_max = max(len(s) for s in seqs)
    stage_pool = np.full((len(rows), s_max), -1, dtype=np.int64)
    for i, seq in enumerate(seqs):
        stage_pool[i, :len(seq)] = seq
    link = pool_links(cluster, pools)
    cross = np.full((len(rows), max(s_max - 1, 0)), np.nan)
    for j in range(s_max - 1):
        for pa, pb in itertools.permutations(range(len(pools)), 2):
            at = (stage_pool[:, j] == pa) & (stage_pool[:, j + 1] == pb)
            if at.any():
                cross[at, j] = cross_time(costs, pools, link, pa, pb, rows[at])
    ga = base["ga"][rows]
    st = build(costs, stage_pool, rows, cross, ga)
    n, fits_split = balance(st, model.n_layers)
    out = step(st, n, ga)
    broken = _reasons(model, base, rows, (stage_pool >= 0).sum(axis=1))
    reason = [COST_RULES[c - 1].name if c else ("" if f and m else NOT_FIT)
              for c, f, m in zip(broken, fits_split, out["fits"])]
    ok = np.array([not r for r in reason])
    tokens = np.where(ok, gb * model.seq_len / out["step_time_s"], np.nan)
    feas = np.flatnonzero(ok)
    order = feas[np.argsort(out["step_time_s"][feas], kind="stable")]
    return HeteroRanking(pools, base, rows, stage_pool, n.astype(int), out["step_time_s"],
                         tokens, out["mem_frac"], reason, order, st)


def world_of(r: HeteroRanking, i: int) -> int:
    b = int(r.base_idx[i])
    return int(r.base["tp"][b] * r.base["dpr"][b]) * int((r.stage_pool[i] >= 0).sum())


def speedup(r: HeteroRanking) -> float:
    """Best layout's speed over the best single-pool one's (nan when either is missing)."""
    one = r.best_single_pool()
    if one is None or not len(r.order):
        return math.nan
    return float(r.step_time_s[one] / r.step_time_s[r.order[0]])


@dataclass(frozen=True)
class PoolPipeline:
    """One pipeline over pools as the engine will run it: the pool and layers of each stage, the
    predicted seconds of each stage per micro-batch (compute, head and loss, its transfers) and
    of the whole step (1F1B fill, steady state and drain, then the all-reduce and optimizer)."""

    pools: tuple[str, ...]
    layers: tuple[int, ...]
    stage_s: tuple[float, ...]
    step_time_s: float
    micro_batches: int


def plan_pipeline(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
                  stage_pools: list[str], micro_batch: int, layers: list[int] | None = None,
                  lowrank: LowRankConfig | None = None) -> PoolPipeline:
    """The planner's split of `model` over one stage per entry of `stage_pools` (pool names, in
    pipeline order; tp 1, dp 1, no recompute), or the prediction for the given `layers`: what
    benchmarks/hetero_cpu.py runs and checks against the measured step."""
    pools = pools_of(cluster)
    names = [p.name for p in pools]
    bad = [s for s in stage_pools if s not in names]
    if bad or not stage_pools:
        raise ValueError(f"stage pools {stage_pools}: each must be one of {names}")
    gb = int(train.global_batch)
    ms = model_shape(model, lowrank)
    sw = software_for(train, cluster)
    base = columns(dpr=np.array([1.0]), dps=1, tp=1, pp=1, cp=1, sp=0, mb=float(micro_batch),
                   rc=float(Recompute.NONE), sched=Schedule.ONE_F_ONE_B, v=1)
    base["ga"] = np.array([gb / micro_batch])
    costs = [pool_costs(ms, p, sw, base) for p in pools]
    idx = [names.index(s) for s in stage_pools]
    link = pool_links(cluster, pools)
    row = np.zeros(1, dtype=np.int64)
    cross = np.array([[cross_time(costs, pools, link, a, b, row)[0]
                       for a, b in zip(idx, idx[1:])]]).reshape(1, -1)
    st = build(costs, np.array([idx]), row, cross, base["ga"])
    n = np.array([layers], dtype=float) if layers else balance(st, model.n_layers)[0]
    out = step(st, n, base["ga"])
    return PoolPipeline(tuple(stage_pools), tuple(int(x) for x in n[0]),
                        tuple(float(x) for x in out["stage_s"][0]),
                        float(out["step_time_s"][0]), int(base["ga"][0]))
