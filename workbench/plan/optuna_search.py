"""Optuna ask/tell over the layout space, for spaces too large to enumerate and for measured
search later (the same ask/tell loop can tell a measured throughput instead of a predicted one).

Infeasible layouts are told, not skipped: structurally invalid ones and those that do not fit get
a constraint value > 0 (Trial.set_constraint, Optuna 5) and their reason as a user attribute, so a
study on disk records why each was never launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import optuna

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import RECOMPUTE, SCHEDULES, Layout
from workbench.plan.search import MICRO_BATCHES, REASONS, SCHED_V, _reasons, divisors, score


@dataclass
class SearchResult:
    layout: Layout | None
    tokens_per_s: float
    n_trials: int
    n_infeasible: int
    study: optuna.Study


def optuna_search(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
                  world_size: int, n_trials: int = 100, seed: int = 0,
                  lowrank: LowRankConfig | None = None,
                  storage: str | None = None, study_name: str | None = None
                  ) -> SearchResult:
    """Seeded TPE search maximizing predicted tokens/s; returns the best feasible layout."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    g = math.gcd(math.gcd(model.n_heads, model.n_kv_heads), model.ffn_hidden)
    divs = divisors(world_size)
    choices = {
        "tp": [d for d in divs if g % d == 0],
        "pp": [d for d in divs if model.n_layers % d == 0],
        "cp": [d for d in divs if model.seq_len % d == 0 and d <= 32],
        "dp_mode": ["shard", "replicate", "hybrid"],
        "micro_batch": list(MICRO_BATCHES),
        "recompute": list(RECOMPUTE),
        "sequence_parallel": [False, True],
        "schedule": [f"{SCHEDULES[s]}-v{v}" for s, v in SCHED_V],
    }
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
    study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage,
                                study_name=study_name, load_if_exists=bool(storage))
    best: tuple[float, Layout | None] = (-1.0, None)
    infeasible = 0
    for _ in range(n_trials):
        trial = study.ask()
        p = {k: trial.suggest_categorical(k, v) for k, v in choices.items()}
        tp, pp, cp = p["tp"], p["pp"], p["cp"]
        sched, v = p["schedule"].rsplit("-v", 1)
        if pp == 1:
            sched, v = "1f1b", "1"
        rest = world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else 0
        reason, value = "", 0.0
        if rest == 0:
            reason = "tp*pp*cp must divide the world size"
        else:
            dps = {"shard": rest, "replicate": 1,
                   "hybrid": math.gcd(rest, max(1, cluster.gpus_per_node // (tp * cp)))}[
                p["dp_mode"]]
            a = {"dpr": rest // dps, "dps": dps, "tp": tp, "pp": pp, "cp": cp,
                 "mb": p["micro_batch"], "rc": RECOMPUTE.index(p["recompute"]),
                 "sp": int(p["sequence_parallel"] and tp > 1),
                 "sched": SCHEDULES.index(sched), "v": int(v)}
            arr = {k: np.array([float(x)]) for k, x in a.items()}
            code = int(_reasons(model, arr, train.global_batch)[0])
            if code:
                reason = REASONS[code]
            else:
                r = score(model, cluster, train, arr, lowrank)
                value = float(r.tokens_per_s[0])
                if r.reason[0]:
                    reason = REASONS[int(r.reason[0])]
                elif value > best[0]:
                    best = (value, r.layout(0))
        trial.set_constraint("feasible", 1.0 if reason else -1.0)
        if reason:
            infeasible += 1
            trial.set_user_attr("infeasible", reason)
        study.tell(trial, value)
    return SearchResult(best[1], max(best[0], 0.0), n_trials, infeasible, study)
