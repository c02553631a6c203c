"""Optuna ask/tell over the layout space, for spaces too large to enumerate and for measured
search later (the same ask/tell loop can tell a measured throughput instead of a predicted one).

The space is parametrized for TPE, not as a flat bag of categories:
- degrees (tp, pp, cp) and the micro-batch are ordered integers indexing their valid values
  (log2-spaced for power-of-two worlds), so TPE can model "a bit more TP" as a neighbour;
- invalid combinations are repaired where the repair is obvious (cp lowered until tp*pp*cp
  divides the world; micro-batch lowered until dp*micro_batch divides the global batch and a
  pipeline gets >= pp micro-batches), so few trials are spent on structural errors;
- recompute and the pipeline's stage split are not sampled: each trial scores its degrees with
  every recompute and every split the exhaustive planner scores (uneven first and last stages)
  and keeps the fastest that fits (one vectorized score; recomputing more than memory needs
  never makes a step faster), which removes the rc x memory cliff TPE stalls on;
  likewise a data-parallel mode that does not fit is repaired towards more parameter sharding
  (replicate -> hybrid -> shard), so a move such as "no pipeline" is not lost to a memory cliff;
- the last `local_share` of the budget is a first-improvement neighbourhood search around the
  best trial so far (one or two parameters one step away, or one parallel dimension switched
  off), enqueued as ordinary trials.
No trial is seeded from the exhaustive ranking. Infeasible layouts are told, not skipped: they
get a constraint value > 0 (Trial.set_constraint) and their reason as a user attribute.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass

import numpy as np
import optuna

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.columns import SCHEDULES, Recompute, Schedule, code, columns
from workbench.plan.cost.software import Software
from workbench.plan.search.exhaustive import MEMORY_REASONS, REASONS, score
from workbench.plan.search.rules import COST_RULES, first_broken, select
from workbench.plan.search.space import MICRO_BATCHES, SCHED_V, divisors
from workbench.plan.search.splits import with_splits

# the rules a micro-batch is repaired against (the batch splits into whole micro-batches, and
# enough of them for the pipeline)
_BATCH_RULES = select(["global batch not divisible by dp*micro_batch",
                       "pipeline needs >= pp micro-batches per step"])


@dataclass
class SearchResult:
    layout: Layout | None
    tokens_per_s: float
    n_trials: int
    n_infeasible: int
    study: optuna.Study


@dataclass
class _Space:
    """Valid values of each sampled parameter (ordered where order means something)."""

    tp: list[int]
    pp: list[int]
    cp: list[int]
    mb: list[int]
    dp_mode: tuple[str, ...] = ("shard", "hybrid", "replicate")
    sched: tuple[str, ...] = tuple(f"{SCHEDULES[s]}-v{v}" for s, v in SCHED_V)

    def suggest(self, trial: optuna.Trial) -> dict:
        p = {k: trial.suggest_int(f"{k}_i", 0, len(getattr(self, k)) - 1)
             for k in ("tp", "pp", "cp", "mb")}
        p["dp_mode"] = trial.suggest_categorical("dp_mode", list(self.dp_mode))
        # conditional: a schedule only means something with pp > 1, SP only with tp > 1
        p["sp"] = self.tp[p["tp"]] > 1 and trial.suggest_categorical("sp", [False, True])
        p["sched"] = trial.suggest_categorical("sched", list(self.sched)) \
            if self.pp[p["pp"]] > 1 else self.sched[1]
        return p

    def neighbours(self, params: dict) -> list[dict]:
        """Trial params one step away: one or two indices +-1 (two: e.g. more cp with a
        smaller micro-batch keeps the tokens per rank), or another value of one categorical."""
        out = []
        ints = ("tp", "pp", "cp", "mb")
        for k in ints:
            here = params[f"{k}_i"]
            # one step either way, or switch this dimension off (index 0: degree 1 / the
            # smallest micro-batch), which no sequence of improving single steps may reach
            for i in {here - 1, here + 1, 0} - {here}:
                if not 0 <= i < len(getattr(self, k)):
                    continue
                out.append({**params, f"{k}_i": i})
                for k2 in ints:
                    if k2 == k:
                        continue
                    for d2 in (-1, 1):
                        j = params[f"{k2}_i"] + d2
                        if 0 <= j < len(getattr(self, k2)):
                            out.append({**params, f"{k}_i": i, f"{k2}_i": j})
        for k, values in (("dp_mode", self.dp_mode), ("sp", (False, True)),
                          ("sched", self.sched)):
            out += [{**params, k: v} for v in values if v != params[k]]
        return out


def _allowed(model: ModelConfig, column: str, values: list[int]) -> list[int]:
    """The values of one degree that break no cost rule in a layout of that degree alone (every
    other degree 1, one GPipe micro-batch, the world size their product)."""
    one = dict(dpr=1, dps=1, tp=1, pp=1, cp=1, sp=0, mb=1, ga=1, rc=Recompute.NONE,
               sched=Schedule.GPIPE, v=1)
    a = columns(**{**one, column: values})
    keep = first_broken(model, a[column], a, COST_RULES) == 0
    return [d for d, ok in zip(values, keep) if ok]


def _space(model: ModelConfig, world: int) -> _Space:
    divs = divisors(world)
    return _Space(tp=_allowed(model, "tp", divs), pp=_allowed(model, "pp", divs),
                  cp=_allowed(model, "cp", [d for d in divs if d <= 32]),
                  mb=list(MICRO_BATCHES))


def _layout_arrays(model: ModelConfig, sp: _Space, p: dict, world: int, gb: int, gpn: int
                   ) -> dict | None:
    """The layout a trial's parameters stand for (field -> value, as columns() takes them),
    after the obvious repairs (None: no repair)."""
    tp, pp = sp.tp[p["tp_i"]], sp.pp[p["pp_i"]]
    cps = [c for c in sp.cp[: p["cp_i"] + 1] if world % (tp * pp * c) == 0]
    if not cps:
        return None
    cp = cps[-1]
    rest = world // (tp * pp * cp)
    dps = {"shard": rest, "replicate": 1, "hybrid": math.gcd(rest, max(1, gpn // (tp * cp)))}[
        p["dp_mode"]]
    sched, v = p["sched"].rsplit("-v", 1)
    s, v = (code(SCHEDULES, sched), int(v)) if pp > 1 else (Schedule.ONE_F_ONE_B, 1)
    mbs = np.array(sp.mb[: p["mb_i"] + 1], dtype=np.float64)
    batch = columns(dpr=rest, dps=1, tp=tp, pp=pp, cp=cp, sp=0, mb=mbs, rc=Recompute.NONE,
                    sched=s, v=v, ga=gb / (rest * mbs))
    fits = mbs[first_broken(model, world, batch, _BATCH_RULES) == 0]
    mb = int(fits[-1]) if len(fits) else sp.mb[0]
    return {"dpr": rest // dps, "dps": dps, "tp": tp, "pp": pp, "cp": cp, "mb": mb,
            "rc": int(Recompute.NONE), "sp": int(p["sp"] and tp > 1), "sched": int(s), "v": v}


def optuna_search(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
                  world_size: int, n_trials: int = 100, seed: int = 0,
                  lowrank: LowRankConfig | None = None,
                  storage: str | None = None, study_name: str | None = None,
                  local_share: float = 0.5, margin_bytes: float = 0.0,
                  software: Software | None = None) -> SearchResult:
    """Seeded TPE search (then a local search) maximizing predicted tokens/s; returns the best
    feasible layout (peak + `margin_bytes` within HBM, as in exhaustive.score). Every trial,
    feasible or not, counts against `n_trials`."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, gb = _space(model, world_size), int(train.global_batch)
    with warnings.catch_warnings():  # group= is "experimental" in Optuna 5; it handles the
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # conditionals
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                             n_startup_trials=10)
    study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage,
                                study_name=study_name, load_if_exists=bool(storage))
    rng = random.Random(seed)
    cache: dict[tuple, tuple[float, str, Layout | None]] = {}

    def evaluate(a: dict) -> tuple[float, str, Layout | None]:
        key = tuple(sorted(a.items()))
        if key not in cache:
            cache[key] = _score_lightest(model, cluster, train, a, lowrank, margin_bytes,
                                         software)
        return cache[key]

    best: tuple[float, Layout | None, dict | None] = (-1.0, None, None)
    infeasible = 0
    n_explore = n_trials - int(local_share * n_trials)
    for k in range(n_trials):
        if k >= n_explore and best[2] is not None:
            fresh = []
            for q in space.neighbours(best[2]):
                a = _layout_arrays(model, space, q, world_size, gb, cluster.gpus_per_node)
                if a is not None and tuple(sorted(a.items())) not in cache:
                    fresh.append(q)
            if fresh:
                q = rng.choice(fresh)
                study.enqueue_trial({k: v for k, v in q.items()
                                     if k in _params_of(space, q)})
        trial = study.ask()
        p = space.suggest(trial)
        p = {**{f"{k}_i": p[k] for k in ("tp", "pp", "cp", "mb")},
             **{k: p[k] for k in ("dp_mode", "sp", "sched")}}
        value, reason, lay = 0.0, "tp*pp must divide the world size", None
        # memory repair, like the recompute one: shard parameters further only when the sampled
        # data-parallel mode does not fit (replicate -> hybrid -> shard)
        for mode in space.dp_mode[: space.dp_mode.index(p["dp_mode"]) + 1][::-1]:
            a = _layout_arrays(model, space, {**p, "dp_mode": mode}, world_size, gb,
                               cluster.gpus_per_node)
            if a is None:
                break
            value, reason, lay = evaluate(a)
            if reason not in MEMORY_REASONS:
                break
        if not reason and value > best[0]:
            best = (value, lay, p)
        trial.set_constraint("feasible", 1.0 if reason else -1.0)
        if reason:
            infeasible += 1
            trial.set_user_attr("infeasible", reason)
        else:
            trial.set_user_attr("layout", lay.key())
        study.tell(trial, value)
    return SearchResult(best[1], max(best[0], 0.0), n_trials, infeasible, study)


def _params_of(space: _Space, q: dict) -> set[str]:
    """The names a trial with these values suggests (sp and sched are conditional)."""
    names = {"tp_i", "pp_i", "cp_i", "mb_i", "dp_mode"}
    if space.tp[q["tp_i"]] > 1:
        names.add("sp")
    if space.pp[q["pp_i"]] > 1:
        names.add("sched")
    return names


def _score_lightest(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, a: dict,
                    lowrank: LowRankConfig | None, margin_bytes: float = 0.0,
                    software: Software | None = None) -> tuple[float, str, Layout | None]:
    """(tokens/s, reason it is infeasible or "", layout) of the fastest layout these degrees
    allow over every recompute and every stage split the exhaustive planner scores. Neither is
    sampled, like the repairs: the lightest recompute that fits is never slower than a heavier
    one, and the best split of a pipeline is a property of its degrees, not a choice TPE can
    learn from neighbours (the split candidates differ per pp * virtual_stages)."""
    rcs = np.array([int(r) for r in Recompute], dtype=np.float64)
    r = score(model, cluster, train, with_splits(columns(**{**a, "rc": rcs}), model), lowrank,
              software, margin_bytes=margin_bytes)
    if len(r.order):
        best = int(r.order[0])
        return float(r.tokens_per_s[best]), "", r.layout(best)
    # a rule of the degrees holds for every row; a memory reason where some split or recompute
    # is valid (the margin's where one fits but too tightly)
    reason = r.reason_of(0)
    for why in MEMORY_REASONS[::-1]:
        if (r.reason == REASONS.index(why)).any():
            reason = why
            break
    return 0.0, reason, None
