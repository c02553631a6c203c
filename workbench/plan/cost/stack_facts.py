"""The typed facts a row (or a plan) may set to override its stack's defaults.

A published run is described by its `stack` (workbench.plan.cost.stacks.STACKS) and, where the
run differed from that stack's defaults, by fact columns of this table: one column per fact,
with a type and the values it takes. Nothing is read from free text, so a new source states
its stack in the same words a user would, and a wrong word is an error, not a silent default.
docs/planner.md ("Stack facts") documents each column once: its values, its default per stack
and its source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from workbench.errors import ConfigError

# Megatron's unfused vocab-parallel cross-entropy: HBM bytes per logit, forward + backward
# (counted op by op in Software.loss_hbm_bytes_per_logit).
MEGATRON_LOSS_BYTES = 52.0

# attention_kernel -> (flash_attention, flash_v1, eager_softmax_bytes)
ATTENTION_KERNELS: dict[str, tuple[bool, bool, float]] = {
    "flash2": (True, False, 0.0),
    "flash1": (True, True, 0.0),
    "fused_softmax": (False, False, 0.0),
    "torch_softmax16": (False, False, 2.0),
    "torch_softmax32": (False, False, 4.0),
}
LOSS_KERNELS: dict[str, float] = {"generic": 0.0, "megatron_unfused": MEGATRON_LOSS_BYTES}


@dataclass(frozen=True)
class Fact:
    """One fact column: its kind (bool | int | choice), the values a choice takes, the least
    value an int takes, and whether it describes the layout rather than the software."""

    kind: str
    choices: tuple[str, ...] = ()
    minimum: int = 0
    layout: bool = False

    def valid(self) -> str:
        if self.kind == "bool":
            return "true or false (or 1 / 0)"
        if self.kind == "int":
            return f"an integer >= {self.minimum}"
        return "one of " + ", ".join(self.choices)


_BOOL = Fact("bool")
FACTS: dict[str, Fact] = {
    "tp_overlap": _BOOL,
    "async_tp": _BOOL,
    "dist_optimizer": _BOOL,
    "compiled": _BOOL,
    "eager_elementwise": _BOOL,
    "norm_kernel": _BOOL,
    "attention_kernel": Fact("choice", tuple(ATTENTION_KERNELS)),
    "cp_algorithm": Fact("choice", ("ring", "allgather")),
    "cp_load_balance": _BOOL,
    "fp8_scaling": Fact("choice", ("tensorwise", "rowwise", "te_delayed")),
    "fsdp_fp8_gather": _BOOL,
    "grad_buffer_bits": Fact("choice", ("16", "32")),
    "loss_kernel": Fact("choice", tuple(LOSS_KERNELS)),
    "pp_group": Fact("int", minimum=0),
    "sequence_parallel": Fact("bool", layout=True),
    "local_batch": Fact("int", minimum=1, layout=True),
}
FactValue = bool | int | str


def parse_fact(column: str, text: str, where: str = "", option: str = "") -> FactValue:
    """The typed value of one fact column; ConfigError naming the column (after `option`, and
    before `where`, e.g. the row) and what is valid for an unknown column or a bad value."""
    fact, name = FACTS.get(column), option + column + where
    if fact is None:
        raise ConfigError(name, text, "a stack fact: one of " + ", ".join(FACTS))
    t = text.strip().lower()
    if fact.kind == "bool" and t in ("true", "1", "false", "0"):
        return t in ("true", "1")
    if fact.kind == "int" and t.isdigit() and int(t) >= fact.minimum:
        return int(t)
    if fact.kind == "choice" and t in fact.choices:
        return t
    raise ConfigError(name, text, fact.valid())


def facts_of(row: Mapping[str, str | None], where: str = "") -> dict[str, FactValue]:
    """The fact columns a row sets (an empty cell keeps the stack's default; columns that are
    not facts are not read)."""
    return {c: parse_fact(c, text, where) for c in FACTS
            if (text := (row.get(c) or "").strip())}


def software_fields(facts: Mapping[str, FactValue]) -> dict[str, object]:
    """The Software fields the software facts set (layout facts are the Layout's, not here)."""
    out: dict[str, object] = {}
    plain = {"tp_overlap": "overlap_tp", "async_tp": "async_tp",
             "dist_optimizer": "dist_optimizer", "compiled": "compiled",
             "eager_elementwise": "eager", "norm_kernel": "norm_kernel",
             "cp_load_balance": "cp_load_balance", "fp8_scaling": "fp8_scaling",
             "fsdp_fp8_gather": "fsdp_fp8_gather", "pp_group": "pp_group"}
    for column, value in facts.items():
        if column in plain:
            out[plain[column]] = value
        elif column == "attention_kernel":
            flash, v1, softmax = ATTENTION_KERNELS[str(value)]
            out |= {"flash_attention": flash, "flash_v1": v1, "eager_softmax_bytes": softmax}
        elif column == "cp_algorithm":
            out["cp_allgather"] = value == "allgather"
        elif column == "grad_buffer_bits":
            out["grad_buffer_bytes"] = int(str(value)) / 8
        elif column == "loss_kernel":
            out["loss_hbm_bytes_per_logit"] = LOSS_KERNELS[str(value)]
    return out


def plan_facts(items: list[str]) -> dict[str, FactValue]:
    """The software facts of the planner's `--stack-fact KEY=VALUE` options (the same columns a
    row sets); ConfigError for a malformed item, an unknown key, a bad value, or a layout fact
    (a plan chooses its own sequence parallelism and batch)."""
    out: dict[str, FactValue] = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError("--stack-fact", item, "KEY=VALUE, e.g. grad_buffer_bits=16")
        if key in FACTS and FACTS[key].layout:
            raise ConfigError(f"--stack-fact {key}", text, "a layout fact of a published row; "
                              "the planner chooses the layout (software facts: " +
                              ", ".join(k for k, f in FACTS.items() if not f.layout) + ")")
        out[key] = parse_fact(key, text, option="--stack-fact ")
    return out
