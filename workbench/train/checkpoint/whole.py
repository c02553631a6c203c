"""Checkpoints that are either whole or ignored.

Each checkpoint is `step_NNNNNNNN.pt` written to a temp file, fsynced and renamed, then a
`step_NNNNNNNN.json` sidecar with its size and sha256 is written the same way. Loading walks
checkpoints newest first and takes the first whose bytes match its sidecar, reporting each one
it skips: a run killed mid-write, or a disk that flipped bits, falls back to the previous good
checkpoint and never loads garbage silently.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from workbench.errors import InputError

_NAME = re.compile(r"step_(\d{8})\.pt$")


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def expired(steps: List[int], keep: int, keep_every: int = 0) -> List[int]:
    """The checkpoints to delete once a new one is whole: all but the newest `keep`, except
    every `keep_every`-th step, kept for good (the points later runs branch off from:
    `train.init_from`)."""
    return [s for s in steps[:-keep] if not (keep_every and s % keep_every == 0)]


class CheckpointDir:
    """The checkpoints of one run; keeps the newest `keep`, and every `keep_every`-th step."""

    def __init__(self, folder: Path, keep: int = 2, keep_every: int = 0):
        self.folder = Path(folder)
        self.keep, self.keep_every = keep, keep_every

    def steps(self) -> List[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir()
                      if (m := _NAME.search(p.name)))

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}.pt"

    def save(self, step: int, state: Dict[str, Any]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        path = self.path(step)
        _atomic_write(path, data)
        side = {"step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(path.with_suffix(".json"), json.dumps(side).encode())
        for old in expired(self.steps(), self.keep, self.keep_every):
            self.path(old).unlink(missing_ok=True)
            self.path(old).with_suffix(".json").unlink(missing_ok=True)
        return path

    def verify(self, step: int) -> Optional[str]:
        """None if the checkpoint is whole, else why not."""
        path, side_path = self.path(step), self.path(step).with_suffix(".json")
        if not side_path.exists():
            return "no sidecar (write interrupted)"
        try:
            side = json.loads(side_path.read_text())
        except ValueError:
            return "unreadable sidecar"
        data = path.read_bytes()
        if len(data) != side.get("bytes"):
            return f"truncated ({len(data)} of {side.get('bytes')} bytes)"
        if hashlib.sha256(data).hexdigest() != side.get("sha256"):
            return "sha256 mismatch (corrupt)"
        return None

    def peek(self, key: str) -> Any:
        """`key` of the newest whole checkpoint (None if absent, or no checkpoint is whole):
        what a loop hook reads before the model is built, to build it in the shapes it was
        saved with."""
        for step in reversed(self.steps()):
            if self.verify(step) is None:
                return torch.load(self.path(step), map_location="cpu",
                                  weights_only=False).get(key)
        return None

    def load_latest(self, template: Optional[Callable[[], Dict[str, Any]]] = None
                    ) -> Optional[Tuple[int, Dict[str, Any]]]:
        """The newest whole checkpoint, or None if there is none at all. Checkpoints that exist
        but are all damaged are an error: silently restarting would discard recorded work.
        `template` (the state to load into) is for sharded checkpoints; a whole file ignores it."""
        bad = []
        for step in reversed(self.steps()):
            why = self.verify(step)
            if why is None:
                state = torch.load(self.path(step), map_location="cpu", weights_only=False)
                for b in bad:
                    print(f"warning: checkpoint {b} skipped; resuming from step {step}",
                          file=sys.stderr)
                return step, state
            bad.append(f"{self.path(step).name}: {why}")
        if bad:
            raise InputError(f"checkpoint dir {self.folder}: no valid checkpoint "
                             f"({'; '.join(bad)}); remove them to start over")
        return None
