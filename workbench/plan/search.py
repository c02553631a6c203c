"""Layout search: score every valid layout at once with the vectorized cost model, or ask Optuna.

The exhaustive path builds the whole space (dp_replicate x dp_shard x tp x pp x cp x virtual
stages x micro-batch x recompute x sequence parallel) as numpy columns and scores it in one call
to terms.evaluate, so even 16k-GPU spaces rank in seconds on one core. Every rejected layout keeps
its first failing rule, so the plan can say why the space shrank. The Optuna path samples the same
space with ask/tell for spaces too large to enumerate and for measured search.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from workbench.config import ClusterConfig, ConfigError, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import RECOMPUTE, SCHEDULES, Layout, validate
from workbench.plan.coefficients import Coefficients, coefficients
from workbench.plan.costmodel import Estimate, estimate, flops_per_step, hardware_for, software_for
from workbench.plan.shapes import model_shape
from workbench.plan.terms import Software, evaluate

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
SCHED_V = ((0, 1), (1, 1), (2, 2), (2, 3), (2, 4))  # (schedule index, virtual stages)
REASONS = ("feasible", "tp must divide heads, kv heads and ffn_hidden",
           "pp*virtual_stages must divide n_layers",
           "cp (x tp with sequence parallel) and 2*cp must divide seq_len",
           "global batch not divisible by dp*micro_batch",
           "pipeline needs >= pp micro-batches per step", "does not fit in GPU memory")


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


def enumerate_space(world: int) -> dict[str, np.ndarray]:
    """The raw layout space as columns (before any validity rule): every degree split crossed
    with micro-batch, recompute, sequence parallel (tp > 1) and schedule (pp > 1)."""
    deg = _degree_tuples(world)
    combos = np.array([(mb, rc, sp, s, v) for mb, rc, sp, (s, v) in itertools.product(
        MICRO_BATCHES, range(3), (0, 1), SCHED_V)], dtype=np.float64)
    k, c = len(deg), len(combos)
    d = np.repeat(deg, c, axis=0)
    x = np.tile(combos, (k, 1))
    keep = ~((d[:, 2] == 1) & (x[:, 2] == 1)) & ~((d[:, 3] == 1) & ~((x[:, 3] == 1)
                                                                     & (x[:, 4] == 1)))
    d, x = d[keep], x[keep]
    return {"dpr": d[:, 0], "dps": d[:, 1], "tp": d[:, 2], "pp": d[:, 3], "cp": d[:, 4],
            "mb": x[:, 0], "rc": x[:, 1], "sp": x[:, 2], "sched": x[:, 3], "v": x[:, 4]}


def _reasons(model: ModelConfig, a: dict[str, np.ndarray], global_batch: int) -> np.ndarray:
    """First failing structural rule of each layout (0 = none), as in layout.validate."""
    g = math.gcd(math.gcd(model.n_heads, model.n_kv_heads), model.ffn_hidden)
    dp = a["dpr"] * a["dps"]
    local = global_batch / (dp * a["mb"])
    split = a["cp"] * np.where(a["sp"] > 0, a["tp"], 1)
    rules = [g % a["tp"] != 0, model.n_layers % (a["pp"] * a["v"]) != 0,
             (model.seq_len % split != 0) | ((a["cp"] > 1) & (model.seq_len % (2 * a["cp"]) != 0)),
             local != np.floor(local),
             (a["pp"] > 1) & (a["sched"] > 0) & (local < a["pp"])]
    reason = np.zeros(len(dp), dtype=np.int8)
    for code in range(len(rules), 0, -1):
        reason = np.where(rules[code - 1], code, reason)
    return reason


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

    def __len__(self) -> int:
        return len(self.reason)

    def layout(self, i: int) -> Layout:
        a = self.arrays
        return Layout(dp_replicate=int(a["dpr"][i]), dp_shard=int(a["dps"][i]),
                      tp=int(a["tp"][i]), pp=int(a["pp"][i]), cp=int(a["cp"][i]),
                      sequence_parallel=bool(a["sp"][i]), micro_batch=int(a["mb"][i]),
                      grad_accum=int(a["ga"][i]), recompute=RECOMPUTE[int(a["rc"][i])],
                      pp_schedule=SCHEDULES[int(a["sched"][i])],
                      virtual_stages=int(a["v"][i]))

    def rejected(self) -> dict[str, int]:
        codes, counts = np.unique(self.reason[self.reason > 0], return_counts=True)
        return {REASONS[int(c)]: int(n) for c, n in zip(codes, counts)}


def score(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
          a: dict[str, np.ndarray], lowrank: LowRankConfig | None = None,
          software: Software | None = None, coeff: Coefficients | None = None) -> Ranking:
    """Score the layouts in `a` (columns as enumerate_space makes them) and rank them."""
    gb = int(train.global_batch)
    reason = _reasons(model, a, gb)
    ok = reason == 0
    sub = {k: v[ok] for k, v in a.items()}
    sub["ga"] = gb / (sub["dpr"] * sub["dps"] * sub["mb"])
    ms, hw = model_shape(model, lowrank), hardware_for(cluster)
    sw = software or software_for(train, cluster)
    t = evaluate(ms, hw, coeff or coefficients(cluster), sw, sub, float(gb))
    n = len(reason)
    full = {k: np.full(n, np.nan) for k in ("tok", "mfu", "step", "mem")}
    world = a["dpr"][0] * a["dps"][0] * a["tp"][0] * a["pp"][0] * a["cp"][0] if n else 1
    model_f, _ = flops_per_step(ms, gb, sub, sw)
    peak = hw.peak_fp32_flops if sw.precision == "fp32" else hw.peak_bf16_flops
    full["step"][ok] = t["step_time_s"]
    full["tok"][ok] = gb * ms.seq_len / t["step_time_s"]
    full["mfu"][ok] = model_f / (t["step_time_s"] * world * peak)
    full["mem"][ok] = t["peak_mem_bytes"]
    reason = np.where(ok & (full["mem"] > hw.hbm_bytes), len(REASONS) - 1, reason)
    arrays = dict(a)
    arrays["ga"] = np.where(ok, gb / (a["dpr"] * a["dps"] * a["mb"]), 0).astype(np.float64)
    feas = np.flatnonzero(reason == 0)
    order = feas[np.argsort(-full["tok"][feas], kind="stable")]
    return Ranking(arrays, reason, full["tok"], full["mfu"], full["step"], full["mem"],
                   hw.hbm_bytes, order)


def rank_layouts(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, world_size: int,
                 lowrank: LowRankConfig | None = None, software: Software | None = None,
                 coeff: Coefficients | None = None) -> Ranking:
    """Enumerate and score the whole space for `world_size` GPUs (ranks fill nodes of
    cluster.gpus_per_node, whatever cluster.nodes says)."""
    if world_size < 1:
        raise ConfigError("world_size", world_size, "must be >= 1")
    return score(model, cluster, train, enumerate_space(world_size), lowrank, software, coeff)


def best_layout(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, world_size: int,
                lowrank: LowRankConfig | None = None) -> Layout:
    """The predicted-fastest layout that fits and that this engine runs (for layout=auto: the
    cost model also ranks layouts other stacks allow, e.g. tp not dividing the vocabulary);
    ConfigError if there is none."""
    r = rank_layouts(model, cluster, train, world_size, lowrank)
    engine_rules: dict[str, int] = {}
    for i in r.order:
        lay = r.layout(int(i))
        try:
            validate(lay, model, world_size)
            return lay
        except ConfigError as err:
            engine_rules[err.valid] = engine_rules.get(err.valid, 0) + 1
    rejected = {**r.rejected(), **engine_rules}
    why = "; ".join(f"{n} {k}" for k, n in sorted(rejected.items(), key=lambda x: -x[1]))
    raise ConfigError("layout", "auto",
                      f"no layout of {model.name} on {world_size} GPU(s) with global batch "
                      f"{train.global_batch} is feasible ({why or 'empty space'})")


def best_estimate(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig,
                  layout: Layout, lowrank: LowRankConfig | None = None) -> Estimate:
    return estimate(model, cluster, train, layout, lowrank)
