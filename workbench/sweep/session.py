"""One sweep as the driver sees it: the typed recipe, the composed base config every trial
starts from, the world size and the on-disk state. Built from the command line (`load`, which
checks everything before anything is created) or from a sweep's plan.json (`from_state`, for
status/collect: the recorded recipe, not the live conf/, defines the sweep).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from workbench.compose import compose_dict, recorded_dict, to_run_config
from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.launch import world_size
from workbench.sweep.backends import Backend
from workbench.sweep.space import Objective, SweepConfig, objectives, params, parse_sweep
from workbench.sweep.state import SweepState


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the run overrides every trial shares, the `+sweep=`/`sweep.*` overrides)."""
    sweep_args = [a for a in argv if a.lstrip("+~").startswith("sweep")]
    return [a for a in argv if a not in sweep_args], sweep_args


@dataclass
class Sweep:
    """Everything one driver invocation works with."""

    sweep: SweepConfig
    objectives: list[Objective]
    base: DictConfig  # composed run config (sweep section removed) every trial starts from
    cfg: RunConfig  # `base` checked: what every trial shares
    base_overrides: list[str]
    state: SweepState
    world_size: int
    study: Any = None
    backend: Backend | None = None

    @property
    def uri(self) -> str:
        return self.cfg.tracking.resolved_uri()


def load(argv: list[str]) -> Sweep:
    """Compose and check everything; raises ConfigError before any state or run is created."""
    base_overrides, sweep_args = split_argv(argv)
    # `sweep.KEY=V` sets or adds (the recipe YAML need not list every SweepConfig field);
    # parse_sweep then rejects keys SweepConfig does not have, naming them.
    sweep_args = [f"++{a}" if a.startswith("sweep.") else a for a in sweep_args]
    composed = compose_dict(base_overrides + sweep_args)
    raw = OmegaConf.to_container(composed.sweep, resolve=True) if composed.sweep else None
    sweep = parse_sweep(raw)  # type: ignore[arg-type]
    objs = objectives(sweep)
    base = compose_dict(sweep.overrides + base_overrides) if sweep.overrides else composed
    base = base.copy()
    base.sweep = None
    cfg = to_run_config(base)
    if cfg.tracking.backend == "none":
        raise ConfigError("tracking", "none", "a sweep reads its objectives from MLflow; "
                          "use tracking=mlflow")
    if sweep.detach and cfg.launcher.name != "slurm":
        raise ConfigError("sweep.detach", True, "needs launcher=slurm (local trials are "
                          "children of the driver)")
    dists = params(sweep)
    for key, dist in dists.items():  # every parameter applies to the schema with its type
        trial = base.copy()
        try:
            OmegaConf.update(trial, key, _first(dist), merge=False)
            to_run_config(trial)
        except ConfigError as e:
            if e.key == key or not e.key.startswith(("layout", "train.global_batch")):
                raise ConfigError(f"sweep.space.{key}", _first(dist), str(e)) from None
        except Exception as e:
            raise ConfigError(f"sweep.space.{key}", _first(dist),
                              " ".join(str(e).split())[:200]) from None
    state = SweepState(Path(sweep.dir) / sweep.name)
    return Sweep(sweep, objs, base, cfg, base_overrides, state, world_size(cfg.launcher))


def from_state(folder: Path) -> Sweep:
    """Reopen a sweep from its plan.json (for status/collect): the recorded sweep config and
    base config, not the live conf/, define it (a plan written before the base config was
    recorded is composed again from its base overrides)."""
    state = SweepState.load(folder)
    plan = state.plan
    sweep = parse_sweep({k: v for k, v in plan["sweep"].items()})
    sweep.resume = True
    if "base_config" in plan:
        base = recorded_dict(plan["base_config"], str(state.plan_path))
    else:
        base = compose_dict(sweep.overrides + plan["base_overrides"]).copy()
        base.sweep = None
    cfg = to_run_config(base, str(state.plan_path))
    if plan.get("tracking_uri"):
        cfg.tracking.uri = plan["tracking_uri"]
    return Sweep(sweep, objectives(sweep), base, cfg, plan["base_overrides"], state,
                 int(plan["world_size"]))


def _first(dist: Any) -> Any:
    return dist.choices[0] if hasattr(dist, "choices") else dist.low
