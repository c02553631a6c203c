"""The exhaustive ranking: score every layout of the space at once with the vectorized cost model.

The whole space (workbench.plan.search.space) is scored in one call to the cost model's
`evaluate`, so even 16k-GPU spaces rank in seconds on one core. Every rejected layout keeps its
first failing rule, so the plan can say why the space shrank; `best_layout` is `layout=auto`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.errors import ConfigError
from workbench.layout import Layout
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.columns import Columns, layout_fields
from workbench.plan.cost.estimate import evaluate, flops_per_step
from workbench.plan.cost.hardware import hardware_for
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.search.rules import COST_RULES, RULES, first_broken
from workbench.plan.search.space import enumerate_space

NOT_FIT = "does not fit in GPU memory"
UNDER_MARGIN = "fits, but leaves less than the memory margin free"
MEMORY_REASONS = (NOT_FIT, UNDER_MARGIN)
# rejection reasons: the cost rules' names (rules reported as one share a name), then memory
REASONS: tuple[str, ...] = ("feasible", *dict.fromkeys(r.name for r in COST_RULES),
                            *MEMORY_REASONS)
_REASON_OF_RULE = np.array([0] + [REASONS.index(r.name) for r in COST_RULES], dtype=np.int8)


def reasons(model: ModelConfig, world: int, a: Columns) -> np.ndarray:
    """REASONS code of the first cost rule each layout breaks (0: none); `a` has `ga`."""
    return _REASON_OF_RULE[first_broken(model, world, a, COST_RULES)]


@dataclass
class Ranking:
    """All layouts of a space with their scores; `order` lists the feasible ones, best first."""

    arrays: dict[str, np.ndarray]
    reason: np.ndarray
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    step_time_s: np.ndarray
    peak_mem_bytes: np.ndarray
    hbm_bytes: float
    order: np.ndarray
    margin_bytes: float = 0.0  # HBM a layout had to leave free to count as fitting

    def __len__(self) -> int:
        return len(self.reason)

    def layout(self, i: int) -> Layout:
        return Layout(**layout_fields(self.arrays, i))

    def reason_of(self, i: int) -> str:
        return REASONS[int(self.reason[i])]

    def rejected(self) -> dict[str, int]:
        codes, counts = np.unique(self.reason[self.reason > 0], return_counts=True)
        return {REASONS[int(c)]: int(n) for c, n in zip(codes, counts)}


def score(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
          a: dict[str, np.ndarray], lowrank: LowRankConfig | None = None,
          software: Software | None = None, coeff: Coefficients | None = None,
          margin_bytes: float = 0.0) -> Ranking:
    """Score the layouts in `a` (columns as enumerate_space makes them) and rank them; a layout
    fits when its predicted peak plus `margin_bytes` stays within HBM (the margin is the user's
    trust in the memory model: what a run must keep free for what the model does not itemize)."""
    gb = int(train.global_batch)
    n = len(a["tp"])
    world = a["dpr"][0] * a["dps"][0] * a["tp"][0] * a["pp"][0] * a["cp"][0] if n else 1
    arrays = {**a, "ga": gb / (a["dpr"] * a["dps"] * a["mb"])}
    reason = reasons(model, world, arrays)
    ok = reason == 0
    sub = {k: v[ok] for k, v in arrays.items()}
    ms, hw = model_shape(model, lowrank), hardware_for(cluster)
    sw = software or software_for(train, cluster)
    t = evaluate(ms, hw, coeff or coefficients(cluster), sw, sub)
    full = {k: np.full(n, np.nan) for k in ("tok", "mfu", "step", "mem")}
    model_f, _ = flops_per_step(ms, gb, sub, sw)
    peak = hw.peak_fp32_flops if sw.precision == "fp32" else hw.peak_bf16_flops
    full["step"][ok] = t["step_time_s"]
    full["tok"][ok] = gb * ms.seq_len / t["step_time_s"]
    full["mfu"][ok] = model_f / (t["step_time_s"] * world * peak)
    full["mem"][ok] = t["peak_mem_bytes"]
    reason = np.where(ok & (full["mem"] + margin_bytes > hw.hbm_bytes),
                      REASONS.index(UNDER_MARGIN), reason)
    reason = np.where(ok & (full["mem"] > hw.hbm_bytes), REASONS.index(NOT_FIT), reason)
    arrays["ga"] = np.where(ok, arrays["ga"], 0).astype(np.float64)
    feas = np.flatnonzero(reason == 0)
    order = feas[np.argsort(-full["tok"][feas], kind="stable")]
    return Ranking(arrays, reason, full["tok"], full["mfu"], full["step"], full["mem"],
                   hw.hbm_bytes, order, margin_bytes)


def rank_layouts(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, world_size: int,
                 lowrank: LowRankConfig | None = None, software: Software | None = None,
                 coeff: Coefficients | None = None, margin_bytes: float = 0.0) -> Ranking:
    """Enumerate and score the whole space for `world_size` GPUs (ranks fill nodes of
    cluster.gpus_per_node, whatever cluster.nodes says); `margin_bytes` as in `score`."""
    if world_size < 1:
        raise ConfigError("world_size", world_size, "must be >= 1")
    return score(model, cluster, train, enumerate_space(world_size, model), lowrank, software,
                 coeff, margin_bytes)


def best_layout(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, world_size: int,
                lowrank: LowRankConfig | None = None, margin_bytes: float = 0.0) -> Layout:
    """The predicted-fastest layout that fits (with `margin_bytes` free) and that this engine
    runs (for layout=auto: the cost model also ranks layouts other stacks allow, e.g. tp not
    dividing the vocabulary); ConfigError if there is none."""
    r = rank_layouts(model, cluster, train, world_size, lowrank, margin_bytes=margin_bytes)
    first = first_broken(model, world_size, {k: v[r.order] for k, v in r.arrays.items()})
    runs = np.flatnonzero(first == 0)
    if len(runs):
        return r.layout(int(r.order[runs[0]]))
    engine_rules: dict[str, int] = {}
    for i, code in zip(r.order, first):
        lay, rule = r.layout(int(i)), RULES[code - 1]
        msg = rule.message(model, world_size, lay)
        engine_rules[msg] = engine_rules.get(msg, 0) + 1
    rejected = {**r.rejected(), **engine_rules}
    why = "; ".join(f"{n} {k}" for k, n in sorted(rejected.items(), key=lambda x: -x[1]))
    raise ConfigError("layout", "auto",
                      f"no layout of {model.name} on {world_size} GPU(s) with global batch "
                      f"{train.global_batch} is feasible ({why or 'empty space'})")
