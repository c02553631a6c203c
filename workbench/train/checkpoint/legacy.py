"""Whole-file checkpoints written by older versions for one process, and the one converter.

Such a run folder holds `checkpoints/step_NNNNNNNN.pt` (model, optimizer keyed by position,
RNG, step) with a `.json` sidecar of its size and sha256. This version does not resume one:
its rank entry refuses the folder with one line saying how to go on, which is to start a new
run from it (`train.init_from`). That path converts the checkpoint once, here, into a DCP
folder keyed by parameter name (the new run's `init/`), which every layout and world size
loads. The file is read and hashed once, in the same pass that loads it.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from workbench.config import RunConfig
from workbench.errors import ConfigError, InputError
from workbench.train.checkpoint.folder import seal
from workbench.train.checkpoint.names import sidecar, step_of, whole_files
from workbench.train.engine.bookkeeping import solo
from workbench.train.model import build
from workbench.train.optimizer import make_optimizer

KEY = "train.init_from"


def read_verified(path: Path) -> Dict[str, Any]:
    """The checkpoint's state, from one read of its bytes that is hashed and loaded."""
    side = json.loads(sidecar(path).read_text())
    data = path.read_bytes()
    if len(data) != side.get("bytes") or hashlib.sha256(data).hexdigest() != side.get("sha256"):
        raise ConfigError(KEY, str(path), "a checkpoint whose bytes match its sidecar "
                          "(this one is truncated or corrupt)")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def convert(path: Path, cfg: RunConfig, dest: Path) -> None:
    """Write a whole-file checkpoint of a one-process run with config `cfg` into `dest` as a
    DCP folder keyed by parameter name (model and optimizer), sealed like any checkpoint.

    The optimizer's state is keyed by position in the file; the positions are those of the
    optimizer the old engine built from the seeded model, so the same model and optimizer are
    built here to give them their names."""
    state = read_verified(path)
    model = build(cfg.model, cfg.train.seed, "cpu")
    optimizer = make_optimizer(list(model.parameters()), cfg)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    dest.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "no process group: saving in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        named = get_optimizer_state_dict(model, optimizer)
        dcp.save({"model": model.state_dict(), "optimizer": named}, checkpoint_id=str(dest),
                 no_dist=True)
    seal(dest, state["next_step"], solo())


def refuse_resume(run_dir: str | Path) -> None:
    """A run folder whose checkpoints are whole files (an older version's) cannot be resumed
    here; the error says how to continue it as a new run."""
    found = whole_files(run_dir)
    if not found:
        return
    steps = ", ".join(str(step_of(p)) for p in found)
    raise InputError(f"{Path(run_dir) / 'checkpoints'} holds whole-file checkpoints of an older "
                     f"workbench (steps {steps}), which this version does not resume; start a "
                     f"new run from them: the old run's overrides plus train.init_from={run_dir} "
                     "train.run_dir=NEW_FOLDER")

