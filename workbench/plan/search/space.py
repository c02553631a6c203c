"""The planner's layout space as columns: every degree split crossed with micro-batch, recompute,
sequence parallel and pipeline schedule, each pipeline once per candidate stage split.

Built as numpy columns (workbench.plan.cost.columns), never as Layout objects: a 16k-GPU space
holds hundreds of thousands of layouts, and the ranking scores them in one vectorized call.
"""

from __future__ import annotations

import itertools

import numpy as np

from workbench.config import ModelConfig
from workbench.plan.cost.columns import Columns, Recompute, Schedule, columns
from workbench.plan.search.rules import select
from workbench.plan.search.splits import with_splits

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# (schedule, virtual stages) pairs the space holds for pp > 1
SCHED_V = ((Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2),
           (Schedule.INTERLEAVED_1F1B, 3), (Schedule.INTERLEAVED_1F1B, 4))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degree_tuples(world: int) -> np.ndarray:
    """Every (dpr, dps, tp, pp, cp) with product == world, as an int array (k, 5)."""
    rows = []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                rest = world // (tp * pp * cp)
                for dps in divisors(rest):
                    rows.append((rest // dps, dps, tp, pp, cp))
    return np.array(rows, dtype=np.float64)


def enumerate_space(world: int, model: ModelConfig | None = None) -> Columns:
    """The raw layout space as columns (before any validity rule): every degree split crossed
    with micro-batch, recompute, sequence parallel and schedule; left out are sequence parallel
    without tp (its rule could only reject them) and schedules without a pipeline (pp = 1 runs
    1F1B with one stage). Given the model, every pipeline is crossed with the stage splits of
    workbench.plan.search.splits (the even split alone otherwise)."""
    deg = _degree_tuples(world)
    combos = np.array([(mb, rc, sp, s, v) for mb, rc, sp, (s, v) in itertools.product(
        MICRO_BATCHES, Recompute, (0, 1), SCHED_V)], dtype=np.float64)
    k, c = len(deg), len(combos)
    d = [np.repeat(deg[:, j], c) for j in range(5)]
    x = [np.tile(combos[:, j], k) for j in range(5)]
    a = columns(dpr=d[0], dps=d[1], tp=d[2], pp=d[3], cp=d[4], mb=x[0], rc=x[1], sp=x[2],
                sched=x[3], v=x[4])
    (sp_rule,) = select(["sequence parallel needs tp > 1"])
    keep = ~sp_rule.breaks(None, world, a) & ~((a["pp"] == 1) & ~(
        (a["sched"] == Schedule.ONE_F_ONE_B) & (a["v"] == 1)))
    a = {name: col[keep] for name, col in a.items()}
    return a if model is None else with_splits(a, model)
