"""One sweep as the driver sees it: the typed recipe, the composed base config every trial
starts from, the world size and the on-disk state. Built from the command line (`load`, which
checks everything before anything is created) or from a sweep's plan.json (`from_state`, for
status/collect: the recorded recipe and base config, not the live conf/, define the sweep),
then opened by `start` (its state, Optuna study, parent run and the launcher its trials start
through), whoever drives it next.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from workbench.compose import compose_dict, recorded_dict, to_run_config
from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.launch import world_size
from workbench.sweep.backends import Backend, make_backend
from workbench.sweep.space import (
    Objective,
    SweepConfig,
    budget,
    grid,
    objectives,
    params,
    parse_sweep,
    use_grid,
)
from workbench.sweep.state import SweepState, open_study
from workbench.track.store import check_tracking
from workbench.track.tracker import create_run


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


def start(sw: Sweep) -> None:
    """Create the sweep's state (plan, study, parent run), or reopen it with sweep.resume."""
    st, sweep = sw.state, sw.sweep
    array = sweep.parallelism if sw.cfg.launcher.name == "slurm" else 1
    check_tracking(sw.cfg, array)  # before any state, run or job exists
    sw.backend = make_backend(sw.cfg, st.folder, sweep.name, sweep.parallelism)  # likewise
    if st.exists():
        if not sweep.resume:
            raise ConfigError("sweep.resume", False, f"{st.folder} already holds this sweep; "
                              "pass sweep.resume=true to continue it, or another sweep.name")
        loaded = SweepState.load(st.folder)
        st.plan, st.trials = loaded.plan, loaded.trials
        st.lock()
        if st.plan.get("sweep", {}).get("space") != sweep.space:
            raise ConfigError("sweep.space", sweep.space, "differs from the sweep being resumed")
        if budget(sweep) != st.plan["budget"]:  # `sweep.n_trials=N sweep.resume=true`
            st.plan["budget"], st.plan["sweep"]["n_trials"] = budget(sweep), sweep.n_trials
            st.plan.pop("finished", None)  # more trials: their comparison is written again
            st.save_plan()
    else:
        st.lock()
        parent = create_run(sw.cfg.tracking, f"sweep-{sweep.name}",
                            {"wb.sweep": sweep.name, "wb.sweep_role": "parent",
                             "wb.launcher": sw.cfg.launcher.name})
        st.create({"sweep": asdict(sweep), "base_overrides": sw.base_overrides,
                   "base_config": OmegaConf.to_container(sw.base, resolve=True),
                   "world_size": sw.world_size, "budget": budget(sweep),
                   "objectives": [asdict(o) for o in sw.objectives],
                   "launcher": sw.cfg.launcher.name, "tracking_uri": sw.uri,
                   "parent_run_id": parent, "created": time.strftime("%Y-%m-%d %H:%M:%S")})
    sampler = _sampler(sweep)
    sw.study = open_study(sweep.storage or st.study_path, sweep.name,
                          [o.direction for o in sw.objectives], sampler)
    recover(sw)


def recover(sw: Sweep) -> None:
    """After a killed driver: Optuna trials asked but never recorded are failed (they never
    ran; the budget counts records, so another proposal replaces them), and records that
    ended but were not yet told are told now."""
    import optuna

    for t in sw.study.get_trials(deepcopy=False):
        if t.number not in sw.state.trials and not t.state.is_finished():
            sw.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    for r in sw.state.with_status("rejected", "failed", "complete"):
        if not r.told:
            if r.status == "complete":
                sw.study.tell(r.number, r.values, skip_if_finished=True)
            else:
                state = optuna.trial.TrialState.PRUNED if r.status == "rejected" else \
                    optuna.trial.TrialState.FAIL
                sw.study.tell(r.number, state=state, skip_if_finished=True)
            sw.state.update(r, told=True)


def _sampler(sweep: SweepConfig) -> Any:
    import optuna

    class AskTellGrid(optuna.samplers.GridSampler):
        """GridSampler for ask/tell: its after_trial calls study.stop() on the last grid point,
        which raises outside study.optimize() before the result is stored; the driver counts
        its budget itself."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    if use_grid(sweep):
        return AskTellGrid(grid(sweep), seed=sweep.seed)  # type: ignore[arg-type]
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=sweep.seed)
    return optuna.samplers.TPESampler(seed=sweep.seed)
