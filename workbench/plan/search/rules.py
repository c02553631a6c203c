"""When a layout can run a model at a world size: every rule written once, over layout columns.

`validate_layout` checks one layout with these rules (a one-row column set) and raises the
ConfigError of the first one it breaks; the exhaustive search rejects whole columns of
layouts with them; the Optuna search draws its degrees from the values they allow. So the run
entry, `layout=auto`, the ranking and Optuna cannot disagree about what is valid.

A rule is a numpy test over the columns of workbench.plan.cost.columns (True where a layout breaks
it), the setting it blames, the one-line message a user gets, and the shorter `name` the planner
counts rejections under. Order matters: a layout is blamed on the first rule it breaks. Engine
rules are limits of this repository's engine only (other stacks run such layouts, so the cost
model still ranks them; `layout=auto` skips them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.layout import RECOMPUTE, SCHEDULES, Layout
from workbench.plan.cost.columns import Columns, Schedule, layout_columns, split_problem

Test = Callable[[ModelConfig, Any, Columns], Any]


@dataclass(frozen=True)
class Rule:
    """One feasibility rule; `message` and `value` describe one broken layout (a Layout)."""

    name: str  # the planner's rejection reason (rules it reports as one share it)
    key: str  # the setting blamed
    breaks: Test  # (model, world size, columns) -> True where a layout breaks the rule
    message: Callable[[ModelConfig, int, Any], str]
    value: Callable[[Any], Any]
    engine: bool = False  # a limit of this engine only; the cost model ranks such layouts


def _positive(field: str, column: str) -> Rule:
    return Rule("degrees, micro-batch and virtual stages must be >= 1", f"layout.{field}",
                lambda m, w, a: a[column] < 1, lambda m, w, lay: "must be >= 1",
                lambda lay: getattr(lay, field))


def _tp_divides(what: str) -> Rule:
    return Rule("tp must divide heads, kv heads and ffn_hidden", "layout.tp",
                lambda m, w, a: _indivisible(getattr(m, what), a["tp"]),
                lambda m, w, lay: f"must divide model.{what}={getattr(m, what)}",
                lambda lay: lay.tp)


def _indivisible(n: Any, d: np.ndarray) -> np.ndarray:
    """True where d does not divide n: n / d is not whole (exact for integers below 2**53, and
    several times faster than a float remainder; d >= 1 is an earlier rule)."""
    q = n / d
    return q != np.floor(q)


def _seq_split(a: Columns) -> np.ndarray:
    """Ranks one sequence is split over: cp, times tp with sequence parallel."""
    return a["cp"] * np.where(a["sp"] > 0, a["tp"], 1)


RULES: tuple[Rule, ...] = (
    *(_positive(f, c) for f, c in (("dp_replicate", "dpr"), ("dp_shard", "dps"), ("tp", "tp"),
                                   ("pp", "pp"), ("cp", "cp"), ("micro_batch", "mb"),
                                   ("virtual_stages", "v"))),
    Rule("unknown recompute", "layout.recompute", lambda m, w, a: a["rc"] < 0,
         lambda m, w, lay: f"must be one of {RECOMPUTE}", lambda lay: lay.recompute),
    Rule("unknown pipeline schedule", "layout.pp_schedule", lambda m, w, a: a["sched"] < 0,
         lambda m, w, lay: f"must be one of {SCHEDULES}", lambda lay: lay.pp_schedule),
    Rule("degrees do not multiply to the world size", "layout",
         lambda m, w, a: a["dpr"] * a["dps"] * a["tp"] * a["pp"] * a["cp"] != w,
         lambda m, w, lay: f"dp_replicate*dp_shard*tp*pp*cp = {lay.world_size} != world size "
                           f"{w}", lambda lay: lay.key()),
    _tp_divides("n_heads"), _tp_divides("n_kv_heads"), _tp_divides("ffn_hidden"),
    Rule("tp must divide the vocabulary", "layout.tp",
         lambda m, w, a: _indivisible(m.vocab, a["tp"]),
         lambda m, w, lay: f"must divide model.vocab={m.vocab}", lambda lay: lay.tp, engine=True),
    Rule("sequence parallel with learned positions", "layout.sequence_parallel",
         lambda m, w, a: (a["sp"] > 0) & (m.family == "gpt2"),
         lambda m, w, lay: "not supported for model.family=gpt2 (learned positions are added "
                           "before the sequence is split); use tp without it",
         lambda lay: True, engine=True),
    Rule("pipeline over tied embeddings", "layout.pp",
         lambda m, w, a: (a["pp"] > 1) & bool(m.tie_embeddings),
         lambda m, w, lay: "pipeline stages cannot share tied embeddings (model.tie_embeddings)",
         lambda lay: lay.pp, engine=True),
    Rule("pp*virtual_stages must divide n_layers", "layout.pp",
         lambda m, w, a: (a["lf"] < 0) & _indivisible(m.n_layers, a["pp"] * a["v"]),
         lambda m, w, lay: f"pp*virtual_stages={lay.pp * lay.virtual_stages} must divide "
                           f"model.n_layers={m.n_layers} (or give layout.stage_layers)",
         lambda lay: lay.pp),
    Rule("stage_layers must split n_layers over pp*virtual_stages", "layout.stage_layers",
         lambda m, w, a: (a["lf"] >= 0) & (a["lsum"] != m.n_layers),
         lambda m, w, lay: split_problem(lay.stage_layers, lay.pp * lay.virtual_stages,
                                         m.n_layers), lambda lay: list(lay.stage_layers)),
    Rule("virtual stages need the interleaved schedule", "layout.virtual_stages",
         lambda m, w, a: (a["v"] > 1) & (a["sched"] != Schedule.INTERLEAVED_1F1B),
         lambda m, w, lay: "virtual stages > 1 need layout.pp_schedule=interleaved_1f1b",
         lambda lay: lay.virtual_stages),
    Rule("interleaved schedule needs virtual stages", "layout.virtual_stages",
         lambda m, w, a: (a["sched"] == Schedule.INTERLEAVED_1F1B) & (a["pp"] > 1) & (a["v"] < 2),
         lambda m, w, lay: "interleaved_1f1b needs virtual_stages >= 2",
         lambda lay: lay.virtual_stages),
    Rule("sequence parallel needs tp > 1", "layout.sequence_parallel",
         lambda m, w, a: (a["sp"] > 0) & (a["tp"] == 1),
         lambda m, w, lay: "needs layout.tp > 1", lambda lay: True),
    Rule("cp (x tp with sequence parallel) and 2*cp must divide seq_len", "layout.cp",
         lambda m, w, a: _indivisible(m.seq_len, _seq_split(a)),
         lambda m, w, lay: f"cp (x tp with sequence parallel) = "
                           f"{lay.cp * (lay.tp if lay.sequence_parallel else 1)} must divide "
                           f"model.seq_len={m.seq_len}", lambda lay: lay.cp),
    Rule("cp (x tp with sequence parallel) and 2*cp must divide seq_len", "layout.cp",
         lambda m, w, a: (a["cp"] > 1) & _indivisible(m.seq_len, 2 * a["cp"]),
         lambda m, w, lay: f"2*cp = {2 * lay.cp} must divide model.seq_len={m.seq_len} "
                           "(each cp rank holds two balanced chunks of the sequence)",
         lambda lay: lay.cp),
    Rule("global batch not divisible by dp*micro_batch", "layout.grad_accum",
         lambda m, w, a: (a["ga"] < 1) | (a["ga"] != np.floor(a["ga"])),
         lambda m, w, lay: "must be >= 1", lambda lay: lay.grad_accum),
    Rule("pipeline needs >= pp micro-batches per step", "train.global_batch",
         lambda m, w, a: (a["pp"] > 1) & (a["sched"] != Schedule.GPIPE) & (a["ga"] < a["pp"]),
         lambda m, w, lay: f"pipeline schedule {lay.pp_schedule} needs at least pp={lay.pp} "
                           f"micro-batches per step, got {lay.grad_accum}; lower "
                           "train.micro_batch or raise train.global_batch",
         lambda lay: lay.global_batch),
)
COST_RULES: tuple[Rule, ...] = tuple(r for r in RULES if not r.engine)


def first_broken(model: ModelConfig, world: Any, a: Columns,
                 rules: Sequence[Rule] = RULES) -> np.ndarray:
    """Per layout, 1 + the index in `rules` of the first rule it breaks (0: none); int16.
    Every rule is evaluated on every layout (a degree of 0 makes later tests nan, not errors)."""
    n = len(a["tp"])
    first = np.zeros(n, dtype=np.int16)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(len(rules) - 1, -1, -1):
            broken = np.broadcast_to(rules[i].breaks(model, world, a), (n,))
            if broken.any():
                np.putmask(first, broken, i + 1)
    return first


def select(names: Sequence[str], rules: Sequence[Rule] = COST_RULES) -> tuple[Rule, ...]:
    """The rules with these names, in rule order."""
    return tuple(r for r in rules if r.name in names)


def validate_layout(layout: Layout, model: ModelConfig, world_size: int) -> None:
    """Reject a layout that cannot run this model at this world size, before any process
    starts; the error names the rule (the first of RULES that it breaks: the rules the planner
    ranks by, so a layout the run refuses is one the ranking rejects)."""
    first = int(first_broken(model, world_size, layout_columns([layout]))[0])
    if first:
        rule = RULES[first - 1]
        raise ConfigError(rule.key, rule.value(layout), rule.message(model, world_size, layout))


def engine_only(e: ConfigError) -> bool:
    """A validate_layout rule that limits this repository's engine, not the cost of a layout:
    published stacks allow uneven pipeline stages (torchtitan, Megatron), tied embeddings across
    stages and SP with learned positions (Megatron)."""
    return (e.key == "layout.pp" and "n_layers" in e.valid) or "tie_embeddings" in e.valid \
        or "model.family" in e.valid
