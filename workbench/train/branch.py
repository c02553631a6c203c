"""Start a run from another run's checkpoint: `train.init_from`.

What long runs need: continue a run past its planned end, branch learning-rate cool-downs off a
long constant-rate run (`train.lr_schedule=wsd`) at several of its checkpoints, move a run to
another layout or world size, or start a new corpus from trained weights. Each is a new run (its
own folder and MLflow run) whose lineage is recorded: tags `wb.init_from` (the checkpoint),
`wb.init_step` and `wb.parent_run_id`.

The driver resolves what the user named (a run folder: its newest complete checkpoint; or one
checkpoint) to one checkpoint before anything is recorded, so the job file, a retry and a rerun
all start from the same weights while the parent run goes on writing checkpoints. Ranks load it
through torch.distributed.checkpoint keyed by parameter name, which reshards into any layout and
world size, from where it is. Only a whole-file checkpoint of an older version is converted,
once, into the new run's folder (`init/`, checkpoint/legacy.py).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.job import JOB_NAME, Job
from workbench.train.checkpoint.names import (
    COMPLETE,
    in_any_layout,
    is_whole_file,
    looks_complete,
    newest_whole_file,
    step_folders,
    step_of,
)

KEY = "train.init_from"
VALID = ("a run folder, or one of its checkpoints (checkpoints/step_N, or "
         "checkpoints/LAYOUT/step_N)")
CONVERTED = "init"  # the new run's copy of an old whole-file checkpoint, keyed by name


@dataclass(frozen=True)
class InitPoint:
    checkpoint: Path  # a checkpoint folder (step_N/), or an old whole file (step_N.pt)
    step: int  # the parent's next step at that checkpoint
    parent: Job

    def tags(self) -> Dict[str, str]:
        return {"wb.init_from": str(self.checkpoint), "wb.init_step": str(self.step),
                "wb.parent_run_id": self.parent.run_id or ""}


def _complete(path: Path) -> bool:
    """A checkpoint whose writing finished; its files are checked when ranks load it."""
    if is_whole_file(path):
        return looks_complete(path)
    return (path / COMPLETE).exists()


def _newest_complete(run_dir: Path) -> Optional[Tuple[int, Path]]:
    """The newest complete checkpoint of a run, in any layout it ran in (or, for a run of an
    older version, its newest whole file), as (step, path)."""
    found = [(step_of(p), p) for p in step_folders(run_dir) if _complete(p)]
    if found:
        return max(found)
    old = newest_whole_file(run_dir)
    return (step_of(old), old) if old is not None else None


def _run_dir_of(path: Path) -> Optional[Path]:
    for folder in [path, *path.parents]:
        if (folder / JOB_NAME).exists():
            return folder
    return None


def find(init_from: str) -> InitPoint:
    """The checkpoint `train.init_from` names, with the run that wrote it."""
    path = Path(init_from).expanduser().resolve()
    path = path if path.exists() else (in_any_layout(path) or path)
    run_dir = _run_dir_of(path) if path.exists() else None
    if run_dir is None:
        raise ConfigError(KEY, init_from, VALID)
    if path == run_dir:
        found = _newest_complete(run_dir)
        if found is None:
            raise ConfigError(KEY, init_from, f"{run_dir} has no complete checkpoint yet")
        step, path = found
    else:
        step = step_of(path)
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
    """Convert an old whole-file checkpoint into `run_dir/init/` (a checkpoint folder needs
    nothing). The parent ran in one process, so its state fits in this one."""
    if is_whole_file(point.checkpoint):
        # imported here: the driver of a job that needs no conversion does not load torch
        from workbench.train.checkpoint.legacy import convert

        convert(point.checkpoint, point.parent.run_config(), run_dir / CONVERTED)


def source(job_dir: str, checkpoint: str) -> Path:
    """Where ranks read the starting state: the parent's folder, or its conversion."""
    return Path(job_dir) / CONVERTED if is_whole_file(checkpoint) else Path(checkpoint)


def load(engine, optimizer, cfg: RunConfig, run_dir: str) -> int:
    """Load the starting state into this rank's engine (and, for init_state=all, optimizer);
    returns the first step to run: the parent's next step, or 0 for weights only."""
    from workbench.train.checkpoint.folder import problem, read  # torch: ranks only

    point = cfg.train.init_from
    everything = cfg.train.init_state == "all"
    path = source(run_dir, point)
    why = problem(path, engine.bookkeeping)
    if why is not None:
        raise ConfigError(KEY, point, f"a checkpoint whose files are whole ({path}: {why})")
    state = read(path, engine.state_dict(optimizer if everything else None), engine.bookkeeping)
    engine.load_state_dict(state, optimizer if everything else None)
    step = step_of(point) if everything else 0
    if engine.is_main:
        what = f"weights, optimizer and step {step}" if everything else "weights"
        print(f"started from {point} ({what})", file=sys.stderr)
    return step or 0
