"""Start a run from another run's checkpoint: `train.init_from`.

What long runs need: continue a run past its planned end, branch learning-rate cool-downs off a
long constant-rate run (`train.lr_schedule=wsd`) at several of its checkpoints, move a run to
another layout or world size, or start a new corpus from trained weights. Each is a new run (its
own folder and MLflow run) whose lineage is recorded: tags `wb.init_from` (the checkpoint),
`wb.init_step` and `wb.parent_run_id`.

The driver resolves what the user named (a run folder: its newest whole checkpoint; or one
checkpoint) to one checkpoint before anything is recorded, so the job file, a retry and a rerun
all start from the same weights while the parent run goes on writing checkpoints. Ranks load it
through torch.distributed.checkpoint keyed by parameter name, which reshards into any layout: a
parent's sharded checkpoint is read where it is; a whole-file one (one process) is converted once
into the new run's folder (`init/`), since its optimizer state is keyed by position.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.job import JOB_NAME, Job

_WHOLE = re.compile(r"step_(\d{8})\.pt$")
_SHARDED = re.compile(r"step_(\d{8})$")
KEY = "train.init_from"
VALID = ("a run folder, or one of its checkpoints (checkpoints/step_N.pt or "
         "checkpoints/LAYOUT/step_N)")
CONVERTED = "init"  # the new run's copy of a whole-file checkpoint, as sharded state


@dataclass(frozen=True)
class InitPoint:
    checkpoint: Path  # a whole file (step_N.pt) or a sharded folder (step_N/)
    step: int  # the parent's next step at that checkpoint
    parent: Job

    def tags(self) -> Dict[str, str]:
        return {"wb.init_from": str(self.checkpoint), "wb.init_step": str(self.step),
                "wb.parent_run_id": self.parent.run_id or ""}


def _complete(path: Path) -> bool:
    """A checkpoint whose writing finished: a whole file whose bytes match its sidecar, or a
    sharded folder with its completion record."""
    if path.is_dir():
        from workbench.train.checkpoint.sharded import DONE

        return (path / DONE).exists()
    from workbench.train.checkpoint.whole import CheckpointDir

    return CheckpointDir(path.parent).verify(int(_WHOLE.search(path.name).group(1))) is None


def _step(path: Path) -> Optional[int]:
    m = (_SHARDED if path.is_dir() else _WHOLE).search(path.name)
    return int(m.group(1)) if m else None


def _newest_complete(run_dir: Path) -> Optional[Tuple[int, Path]]:
    """The newest complete checkpoint of a run, in any layout it ran in, as (step, path);
    checked newest first, since checking a whole file reads all of it."""
    base = run_dir / "checkpoints"
    paths = list(base.glob("step_*.pt")) + [p for p in base.glob("*/step_*") if p.is_dir()]
    steps = sorted(((s, p) for p in paths if (s := _step(p)) is not None), reverse=True)
    return next(((s, p) for s, p in steps if _complete(p)), None)


def _run_dir_of(path: Path) -> Optional[Path]:
    for folder in [path, *path.parents]:
        if (folder / JOB_NAME).exists():
            return folder
    return None


def find(init_from: str) -> InitPoint:
    """The checkpoint `train.init_from` names, with the run that wrote it."""
    path = Path(init_from).expanduser().resolve()
    run_dir = _run_dir_of(path) if path.exists() else None
    if run_dir is None:
        raise ConfigError(KEY, init_from, VALID)
    if path == run_dir:
        found = _newest_complete(run_dir)
        if found is None:
            raise ConfigError(KEY, init_from, f"{run_dir} has no complete checkpoint yet")
        step, path = found
    else:
        step = _step(path)
        if step is None or not _complete(path):
            raise ConfigError(KEY, init_from, VALID + " whose writing finished")
    return InitPoint(path, step, Job.load(run_dir))


# What the weights' shapes and meaning depend on. The rest may change from the checkpoint's: a
# Llama-family run extended to longer sequences raises seq_len and rope_theta (RoPE tables are
# computed, not saved), as Llama 3's long-context stage did; learned positions (gpt2) have one
# row per position, so there seq_len counts too.
WEIGHT_KEYS = ("family", "n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab",
               "tie_embeddings", "bias")


def check(point: InitPoint, cfg: RunConfig) -> None:
    """The parent's weights fit this run's model, and the run has steps left to take."""
    parent = point.parent.run_config()
    mine, theirs = asdict(cfg.model), asdict(parent.model)
    for key in WEIGHT_KEYS + (("seq_len",) if cfg.model.family == "gpt2" else ()):
        if mine[key] != theirs.get(key):
            raise ConfigError(f"model.{key}", mine[key], f"the checkpoint in {KEY} was written "
                              f"by a model with {key}={theirs.get(key)!r}")
    for who, mode in (("this run", cfg.lowrank.mode), ("the checkpoint's run",
                                                       parent.lowrank.mode)):
        if mode != "off":
            raise ConfigError("lowrank.mode", mode, f"{KEY} starts full-rank runs from "
                              f"full-rank checkpoints ({who} is {mode})")
    if cfg.train.init_state == "all" and point.step >= cfg.train.steps:
        raise ConfigError("train.steps", cfg.train.steps, f"must be > {point.step}, the step "
                          f"the checkpoint in {KEY} continues from (train.init_state=all)")


def prepare(point: InitPoint, run_dir: Path) -> None:
    """Write a whole-file checkpoint into `run_dir/init/` as sharded, name-keyed state, which
    every layout loads (a sharded parent needs nothing). The parent ran in one process, so its
    state fits in this one."""
    if point.checkpoint.is_dir():
        return
    import torch
    import torch.distributed.checkpoint as dcp

    from workbench.train.engine.local import named_optim_state
    from workbench.train.model import build
    from workbench.train.optimizer import make_optimizer

    cfg = point.parent.run_config()
    model = build(cfg.model, cfg.train.seed, "cpu")
    optimizer = make_optimizer(list(model.parameters()), cfg)
    state = torch.load(point.checkpoint, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    with warnings.catch_warnings():  # "no process group: saving in a single process", as meant
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optimizer": named_optim_state(model, optimizer)},
                 checkpoint_id=str(run_dir / CONVERTED))


def source(job_dir: str, checkpoint: str) -> str:
    """Where ranks read the starting state: the parent's sharded folder, or its conversion."""
    return checkpoint if Path(checkpoint).is_dir() else str(Path(job_dir) / CONVERTED)


def load(engine, optimizer, cfg: RunConfig, run_dir: str) -> int:
    """Load the starting state into this rank's engine (and, for init_state=all, optimizer);
    returns the first step to run: the parent's next step, or 0 for weights only."""
    import torch.distributed.checkpoint as dcp

    point = cfg.train.init_from
    everything = cfg.train.init_state == "all"
    state = {"model": engine.state_dict()}
    if everything:
        state["optimizer"] = engine.named_optim_state_dict(optimizer)
    with warnings.catch_warnings():  # one process loads without a process group, as meant
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=source(run_dir, point))
    engine.load_state_dict(state["model"])
    if everything:
        engine.load_named_optim_state_dict(optimizer, state["optimizer"])
    step = _step(Path(point)) if everything else 0
    if engine.is_main:
        what = f"weights, optimizer and step {step}" if everything else "weights"
        print(f"started from {point} ({what})", file=sys.stderr)
    return step or 0
