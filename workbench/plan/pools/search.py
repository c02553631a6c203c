"""Layout search over pools: which pools, in which pipeline order, and every layout on them.

The space: every ordered choice of pools (one pool alone answers "is the fast pool enough?"),
crossed with tensor-parallel degree tp (inside a node of every chosen pool), one data-parallel
degree dp for every stage (what the engine runs), micro-batch, recompute and sequence parallel.
A chosen pool is used whole: its GPUs hold tp-GPU replicas, filled in pipeline order dp
replicas a stage (workbench.plan.pools.placement.fill), so where a pool's replicas are not a
whole number of stages, one stage straddles it and the next pool: a mixed stage. Every layout
gets its own layer split (workbench.plan.pools.pipeline.balance) and is checked by the cost
rules every planner path shares (workbench.plan.search.rules), as a pipeline of all its stages.
`price` scores any given placements the same way (`--explain` a user's layout).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.plan.cost.columns import RECOMPUTE, Columns, Recompute, Schedule, columns
from workbench.plan.cost.shapes import ModelShape, model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.pools.cluster import Pool, pool_links, pools_of
from workbench.plan.pools.costs import pool_costs
from workbench.plan.pools.pipeline import LinkArrays, Stages, balance, build, step
from workbench.plan.pools.placement import Members, Placement, StagePlace, fill
from workbench.plan.search.exhaustive import NOT_FIT
from workbench.plan.search.rules import COST_RULES, first_broken
from workbench.plan.search.space import MICRO_BATCHES, divisors

# a pool-ranking key: tp, cp (when > 1), dp_replicate, dp_shard (when > 1), micro-batch, SP, rc
KEY = re.compile(r"tp(\d+)(?:_cp(\d+))?_dp(\d+)(?:_dps(\d+))?_mb(\d+)(_sp)?(?:_rc-([a-z-]+))?")


def arrangements(n_pools: int) -> list[tuple[int, ...]]:
    """Every ordered selection of distinct pools, singles first."""
    return [p for k in range(1, n_pools + 1) for p in itertools.permutations(range(n_pools), k)]


def base_space(pools: list[Pool], gb: int) -> dict[str, np.ndarray]:
    """(tp, dp, mb, rc, sp) rows any arrangement may use, as pipeline-free columns; dp divides
    the GPUs of some selection of pools (a stage may straddle two of them)."""
    tps = sorted({d for p in pools for d in divisors(p.spec.gpus_per_node)})
    sums = {sum(p.gpus for p in c) for k in range(1, len(pools) + 1)
            for c in itertools.combinations(pools, k)}
    dps = sorted({d for g in sums for d in divisors(g)})
    rows = [(dp, tp, mb, rc, sp) for tp, dp, mb, rc, sp in itertools.product(
        tps, dps, MICRO_BATCHES, Recompute, (0, 1)) if gb % (dp * mb) == 0 and (sp == 0 or tp > 1)]
    t = np.array(rows, dtype=np.float64).T
    a = columns(dpr=t[0], dps=1, tp=t[1], pp=1, cp=1, sp=t[4], mb=t[2], rc=t[3],
                sched=Schedule.ONE_F_ONE_B, v=1)
    a["ga"] = gb / (a["dpr"] * a["mb"])
    return a


def base_key(a: Columns, b: int) -> str:
    """`tp2_dp4_mb1_sp_rc-full` (cp and dp_shard shown where > 1): the degrees a placement
    leaves open, as the pool ranking prints them (KEY parses it)."""
    rc = RECOMPUTE[int(a["rc"][b])]
    cp, dps = int(a["cp"][b]), int(a["dps"][b])
    return (f"tp{int(a['tp'][b])}{f'_cp{cp}' if cp > 1 else ''}_dp{int(a['dpr'][b])}"
            f"{f'_dps{dps}' if dps > 1 else ''}_mb{int(a['mb'][b])}"
            f"{'_sp' if a['sp'][b] else ''}{'' if rc == 'none' else '_rc-' + rc}")


@dataclass
class Priced:
    """Placements over pools, scored: the stage matrices, split and step of each."""

    pools: list[Pool]
    base: Columns
    base_idx: np.ndarray  # (N,) row of `base`
    members: Members  # (N, S, K) pools of each stage's replicas
    layers: np.ndarray  # (N, S) layers of each stage
    split_ok: np.ndarray  # (N,) the split holds every layer within memory
    out: dict[str, np.ndarray]  # pipeline.step's figures
    detail: Stages

    def placement(self, i: int) -> Placement:
        m = self.members
        stages = []
        for j in range(m.pool.shape[1]):
            held = [(self.pools[int(p)].name, int(h - lo))
                    for p, lo, h in zip(m.pool[i, j], m.lo[i, j], m.hi[i, j]) if p >= 0]
            if held:
                stages.append(StagePlace(tuple(held), int(self.layers[i, j])))
        return Placement(tuple(stages))

    def gpus(self, i: int) -> int:
        b, a = int(self.base_idx[i]), self.base
        per_replica = int(a["tp"][b] * a["cp"][b] * a["dps"][b])
        return per_replica * int(self.members.hi[i].max(axis=1).sum())


def price(ms: ModelShape, pools: list[Pool], links: LinkArrays, sw: Software, base: Columns,
          base_idx: np.ndarray, members: Members, layers: np.ndarray | None = None,
          margin_bytes: float = 0.0) -> Priced:
    """Score placements `members` of base layouts `base_idx` (rows of `base`, with `ga`): with
    the given `layers` (N, S), else the split that balances them; every member keeps
    `margin_bytes` of its GPUs' memory free."""
    costs = [replace(c, hbm_bytes=c.hbm_bytes - margin_bytes)
             for c in (pool_costs(ms, p, sw, base) for p in pools)]
    ga = base["ga"][base_idx]
    st = build(costs, members, base_idx, ga, links)
    if layers is None:
        n, ok = balance(st, ms.n_layers)
    else:
        n, ok = layers.astype(float), np.ones(len(base_idx), dtype=bool)
    return Priced(pools, base, base_idx, members, n.astype(int), ok, step(st, n, ga), st)


def reasons(model: ModelConfig, p: Priced) -> list[str]:
    """Why each placement cannot run ("" where it can): the first cost rule it breaks, as a
    pipeline of its stages with its split, else whether every member fits in memory."""
    a = {k: v[p.base_idx] for k, v in p.base.items()}
    on = p.members.pool.max(axis=2) >= 0
    n_st = on.sum(axis=1)
    mid = np.where(on & (np.arange(on.shape[1]) > 0) & (np.arange(on.shape[1]) < n_st[:, None]
                                                         - 1), p.layers, 0)
    ok = p.split_ok  # where no split fits, the rules see a placeholder one (memory is blamed)
    a.update(pp=n_st.astype(float), sched=np.full(len(n_st), float(Schedule.ONE_F_ONE_B)),
             lf=np.where(ok, p.layers[:, 0], 0.0),
             ll=np.where(ok, p.layers[np.arange(len(n_st)), n_st - 1], 0.0),
             lm=np.where(ok, mid.max(axis=1), 1.0),
             lsum=np.where(ok, p.layers.sum(axis=1), model.n_layers).astype(float))
    world = a["dpr"] * a["dps"] * a["tp"] * a["cp"] * a["pp"]
    broken = first_broken(model, world, a, COST_RULES)
    return [COST_RULES[c - 1].name if c else ("" if f and m else NOT_FIT)
            for c, f, m in zip(broken, p.split_ok, p.out["fits"])]


@dataclass
class HeteroRanking(Priced):
    """Every layout over the cluster's pools, scored; `order` lists the feasible, best first."""

    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mem_frac: np.ndarray  # the fullest member's share of its GPUs' memory
    reason: list[str]  # "" where feasible
    order: np.ndarray

    def __len__(self) -> int:
        return len(self.base_idx)

    def uses(self, i: int) -> tuple[str, ...]:
        """The pools of layout i in pipeline order."""
        return self.placement(i).pools()

    def key(self, i: int) -> str:
        return base_key(self.base, int(self.base_idx[i]))

    def stages(self, i: int) -> str:
        """`h100:10x4 | h100+a100:8 | a100:6-5x7`: the stages with their pools and layers."""
        return self.placement(i).text()

    def mixed(self, i: int) -> bool:
        return any(s.mixed for s in self.placement(i).stages)

    def best_single_pool(self) -> int | None:
        """The best feasible layout that uses one pool only (None if there is none)."""
        return next((int(i) for i in self.order if len(self.uses(int(i))) == 1), None)

    def rejected(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.reason:
            if r:
                out[r] = out.get(r, 0) + 1
        return out


def _layouts(pools: list[Pool], base: dict[str, np.ndarray]) -> tuple[np.ndarray, Members]:
    """(base row, stages) of every layout: a base row on an arrangement whose pools it fills
    whole (tp inside their nodes, their tp-GPU replicas a whole number of dp-replica stages).
    The stages depend on the arrangement, tp and dp only, so each is filled once."""
    rows, which, shapes = [], [], []
    tp, dp = base["tp"].astype(int), base["dpr"].astype(int)
    for arr in arrangements(len(pools)):
        fits = np.ones(len(tp), dtype=bool)
        slots = np.zeros(len(tp), dtype=int)
        for p in arr:
            fits &= pools[p].spec.gpus_per_node % tp == 0
            slots += pools[p].gpus // tp
        ok = np.flatnonzero(fits & (slots % dp == 0))
        for t, d in sorted(set(zip(tp[ok].tolist(), dp[ok].tolist()))):
            sel = ok[(tp[ok] == t) & (dp[ok] == d)]
            rows.append(sel)
            which.append(np.full(len(sel), len(shapes)))
            shapes.append(fill([(p, pools[p].gpus // t) for p in arr], d))
    m = Members.of(shapes)
    at = np.concatenate(which)
    return np.concatenate(rows).astype(np.int64), Members(m.pool[at], m.lo[at], m.hi[at])


def rank_pools(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
               lowrank: LowRankConfig | None = None, software: Software | None = None,
               margin_bytes: float = 0.0) -> HeteroRanking:
    """Score every layout over the cluster's pools (workbench.plan.pools.pools_of); every stage
    keeps `margin_bytes` of its GPUs' memory free (the split balances within the rest, and
    mem_frac is a share of the rest)."""
    pools = pools_of(cluster)
    gb = int(train.global_batch)
    base = base_space(pools, gb)
    rows, members = _layouts(pools, base)
    links = LinkArrays.of(pools, pool_links(cluster, pools))
    p = price(model_shape(model, lowrank), pools, links, software or software_for(train, cluster),
              base, rows, members, margin_bytes=margin_bytes)
    reason = reasons(model, p)
    ok = np.array([not r for r in reason])
    step_s = p.out["step_time_s"]
    tokens = np.where(ok, gb * model.seq_len / step_s, np.nan)
    feas = np.flatnonzero(ok)
    order = feas[np.argsort(step_s[feas], kind="stable")]
    return HeteroRanking(**vars(p), step_time_s=step_s, tokens_per_s=tokens,
                         mem_frac=p.out["mem_frac"], reason=reason, order=order)


def world_of(r: Priced, i: int) -> int:
    return r.gpus(i)


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
    base = columns(dpr=np.array([1.0]), dps=1, tp=1, pp=1, cp=1, sp=0, mb=float(micro_batch),
                   rc=float(Recompute.NONE), sched=Schedule.ONE_F_ONE_B, v=1)
    base["ga"] = np.array([gb / micro_batch])
    row = np.zeros(1, dtype=np.int64)
    p = price(model_shape(model, lowrank), pools, LinkArrays.of(pools, pool_links(cluster, pools)),
              software_for(train, cluster), base, row,
              Members.single(np.array([[names.index(s) for s in stage_pools]])),
              np.array([layers]) if layers else None)
    return PoolPipeline(tuple(stage_pools), tuple(int(x) for x in p.layers[0]),
                        tuple(float(x) for x in p.out["stage_s"][0]),
                        float(p.out["step_time_s"][0]), int(base["ga"][0]))
