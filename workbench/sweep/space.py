"""What a sweep is: the typed `SweepConfig` behind `+sweep=NAME`, its search space and objectives.

Everything here is checked before anything is recorded or submitted, so a bad sweep definition
(an unknown key, an empty space, an objective the training loop never logs) ends with one line
and exit status 2 instead of a half-launched array.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.places import SWEEPS_DIR

# Metrics the training loop logs, with the direction that makes them better.
LOGGED_METRICS: dict[str, str] = {
    "tokens_per_s": "maximize", "mfu": "maximize", "val_loss": "minimize", "loss": "minimize",
    "step_time_s": "minimize", "peak_mem_bytes": "minimize", "grad_norm": "minimize"}
SAMPLERS = ("auto", "grid", "tpe", "random")
STORAGE_URL = re.compile(r"^(postgresql|mysql|sqlite|oracle|mssql)(\+\w+)?://")
# Config sections a trial may not change: all trials of a sweep share one launcher (one array).
FIXED_SECTIONS = ("launcher", "tracking", "sweep")


@dataclass
class SweepConfig:
    """The `sweep:` section. `space` mirrors the run config: `{layout: {tp: [1, 2]}}` searches
    layout.tp over two choices; `{train: {lr: {low: 1e-4, high: 1e-2, log: true}}}` a range."""

    name: str = ""
    description: str = ""
    space: dict[str, Any] = field(default_factory=dict)
    objectives: list[str] = field(default_factory=lambda: ["tokens_per_s"])  # metric[:direction]
    overrides: list[str] = field(default_factory=list)  # applied to every trial (short probes)
    n_trials: int = 16  # proposals, rejected ones included
    array_size: int = 64  # trials per submitted job array (one round)
    parallelism: int = 4  # array tasks (or local processes) running at once
    sampler: str = "auto"  # auto: grid when every parameter is a list, else tpe
    seed: int = 0
    reject_infeasible: bool = True  # the cost model's "does not fit" rejects a layout
    mem_margin_gib: float = 0.0  # ... as does one predicted to leave less than this free
    min_pred_ratio: float = 0.0  # reject layouts predicted slower than this x the best predicted
    resume: bool = False
    detach: bool = False  # submit and return; then `python -m workbench.sweep status|collect`
    # (local trials run in sessions of their own, up to `parallelism`; collect starts the rest)
    poll_s: float = 2.0
    dir: str = SWEEPS_DIR  # sweep state lives in DIR/NAME
    # The Optuna storage: empty = a journal file in the sweep's folder (one machine, or a shared
    # filesystem); else an RDB URL every worker reaches (postgresql://..., sqlite:///...).
    storage: str = ""


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: str  # maximize | minimize


def parse_sweep(raw: Mapping[str, Any] | None) -> SweepConfig:
    """The typed sweep config; an unknown key or a bad value raises ConfigError naming it."""
    if raw is None:
        raise ConfigError("sweep", None, "use +sweep=NAME with a file in conf/sweep/")
    known = {f.name: f for f in fields(SweepConfig)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"sweep.{key}", value, f"unknown key; valid: {', '.join(known)}")
        default = getattr(SweepConfig(), key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"sweep.{key}", value, "must be true or false")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"sweep.{key}", value, "must be a number")
            value = type(default)(value)
        elif isinstance(default, list):
            value = [value] if isinstance(value, str) else list(value)
        values[key] = value
    sweep = SweepConfig(**values)
    if sweep.storage and not STORAGE_URL.match(sweep.storage):
        raise ConfigError("sweep.storage", sweep.storage, "empty (a journal file in the sweep "
                          "folder) or an RDB URL: postgresql://USER@HOST:PORT/DB, sqlite:///PATH")
    for key in ("n_trials", "array_size", "parallelism"):
        if getattr(sweep, key) <= 0:
            raise ConfigError(f"sweep.{key}", getattr(sweep, key), "must be > 0")
    if not (math.isfinite(sweep.mem_margin_gib) and sweep.mem_margin_gib >= 0):
        raise ConfigError("sweep.mem_margin_gib", sweep.mem_margin_gib,
                          "a non-negative number of GiB a layout must leave free")
    if sweep.sampler not in SAMPLERS:
        raise ConfigError("sweep.sampler", sweep.sampler, f"must be one of {', '.join(SAMPLERS)}")
    if not sweep.name or "/" in sweep.name:
        raise ConfigError("sweep.name", sweep.name, "must be a non-empty folder name")
    objectives(sweep)
    params(sweep)
    return sweep


def objectives(sweep: SweepConfig) -> list[Objective]:
    """`tokens_per_s` or `val_loss:minimize`; only metrics the loop logs are accepted."""
    if not sweep.objectives:
        raise ConfigError("sweep.objectives", [],
                          f"name at least one of {', '.join(LOGGED_METRICS)}")
    out = []
    for text in sweep.objectives:
        metric, _, direction = str(text).partition(":")
        if metric not in LOGGED_METRICS:
            raise ConfigError("sweep.objectives", text,
                              f"{metric!r} is never logged; valid: {', '.join(LOGGED_METRICS)}")
        direction = {"max": "maximize", "min": "minimize"}.get(direction, direction)
        direction = direction or LOGGED_METRICS[metric]
        if direction not in ("maximize", "minimize"):
            raise ConfigError("sweep.objectives", text, "direction must be maximize or minimize")
        out.append(Objective(metric, direction))
    if len({o.metric for o in out}) != len(out):
        raise ConfigError("sweep.objectives", sweep.objectives, "each metric at most once")
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and not {"low", "high"} & set(value):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _schema_default(key: str) -> Any:
    node: Any = RunConfig()
    parent: Any = None
    name = ""
    for i, part in enumerate(key.split(".")):
        if isinstance(node, dict):  # a map keyed by the user's names: searchable if of floats
            value_type = typing.get_args(typing.get_type_hints(type(parent)).get(name))[1:]
            last = i == len(key.split(".")) - 1
            return 0.0 if value_type == (float,) and last else KeyError(key)
        if not hasattr(node, part):
            return KeyError(key)
        parent, name, node = node, part, getattr(node, part)
    return node


def params(sweep: SweepConfig) -> dict[str, Any]:
    """The space as {config key: optuna distribution}, checked against the run config schema."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    flat = _flatten(sweep.space)
    if not flat:
        raise ConfigError("sweep.space", sweep.space, "is empty; name config keys to search")
    out: dict[str, Any] = {}
    for key, spec in flat.items():
        where = f"sweep.space.{key}"
        default = _schema_default(key)
        if isinstance(default, (KeyError, dict, list)) or \
                hasattr(default, "__dataclass_fields__"):
            raise ConfigError(where, spec, f"{key!r} is not a run config value")
        if key.split(".")[0] in FIXED_SECTIONS:
            raise ConfigError(where, spec, "launcher and tracking are fixed for a whole sweep")
        if isinstance(spec, (list, tuple)):
            if not spec:
                raise ConfigError(where, [], "has no choices")
            bad = [c for c in spec if not isinstance(c, type(default))
                   and not (isinstance(default, float) and isinstance(c, int))]
            if bad:
                raise ConfigError(where, bad[0], f"must be {type(default).__name__}")
            out[key] = CategoricalDistribution(list(spec))
        elif isinstance(spec, Mapping):
            extra = set(spec) - {"low", "high", "log", "step"}
            if extra or "low" not in spec or "high" not in spec:
                raise ConfigError(where, dict(spec), "a range is {low, high[, log][, step]}")
            low, high = spec["low"], spec["high"]
            if not low < high or (spec.get("log") and low <= 0):
                raise ConfigError(where, dict(spec), "needs low < high (and low > 0 with log)")
            if isinstance(default, int) and not isinstance(default, bool):
                out[key] = IntDistribution(int(low), int(high), log=bool(spec.get("log")),
                                           step=int(spec.get("step", 1)))
            elif isinstance(default, float):
                out[key] = FloatDistribution(float(low), float(high), log=bool(spec.get("log")),
                                             step=spec.get("step"))
            else:
                raise ConfigError(where, dict(spec), f"a range needs a number; {key} is not")
        else:
            raise ConfigError(where, spec, "must be a list of choices or {low, high}")
    return out


def grid(sweep: SweepConfig) -> dict[str, list[Any]] | None:
    """The full grid when every parameter is a list of choices, else None."""
    flat = _flatten(sweep.space)
    if all(isinstance(v, (list, tuple)) for v in flat.values()):
        return {k: list(v) for k, v in flat.items()}
    return None


def grid_size(space: Mapping[str, list[Any]]) -> int:
    return math.prod(len(v) for v in space.values())


def use_grid(sweep: SweepConfig) -> bool:
    if sweep.sampler == "grid":
        if grid(sweep) is None:
            raise ConfigError("sweep.sampler", "grid", "every space entry must be a list")
        return True
    return sweep.sampler == "auto" and grid(sweep) is not None


def budget(sweep: SweepConfig) -> int:
    """Proposals to make: n_trials, but never more than a grid has points."""
    g = grid(sweep) if use_grid(sweep) else None
    return min(sweep.n_trials, grid_size(g)) if g else sweep.n_trials


def overrides_of(trial_params: Mapping[str, Any]) -> list[str]:
    """Hydra overrides that set a trial's parameters (recorded in its manifest)."""
    return [f"{k}={_literal(v)}" for k, v in sorted(trial_params.items())]


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
