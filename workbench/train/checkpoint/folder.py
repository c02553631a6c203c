"""Checkpoints with torch.distributed.checkpoint (DCP) for every world size, whole or ignored.

`step_NNNNNNNN/` holds the DCP shards of the model and optimizer (keyed by parameter name, so a
checkpoint written by one layout or world size loads into another: DCP reshards on load), one
small file per rank with what is per-rank (RNG state, step, the hooks' state), and last a
`complete.json` that rank 0 writes once every rank has finished, listing every file's size and
sha256. A folder without it (a run killed mid-save) is not a checkpoint; one whose files do not
match it (a disk that flipped bits) is reported and skipped, and the run resumes from the
previous good one: garbage is never loaded silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from workbench.errors import InputError
from workbench.train.checkpoint.names import COMPLETE, step_name, step_of
from workbench.train.engine.bookkeeping import Bookkeeping

SHARDED = ("model", "optimizer")  # what DCP holds; the rest is per rank


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


def expired(steps: List[int], keep: int, keep_every: int = 0) -> List[int]:
    """The checkpoints to delete once a new one is whole: all but the newest `keep`, except
    every `keep_every`-th step, kept for good (the points later runs branch off from:
    `train.init_from`)."""
    return [s for s in steps[:-keep] if not (keep_every and s % keep_every == 0)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _extra_name(rank: int) -> str:
    return f"extra_rank{rank:05d}.pt"


def _dcp_io(fn: Callable[..., Any], state: Dict[str, Any], path: Path,
            books: Bookkeeping) -> None:
    """dcp.save or dcp.load; one rank skips DCP's collectives (and its warning that a
    process without a group saves alone, as meant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fn(state, checkpoint_id=str(path), no_dist=books.world_size == 1)


def seal(path: Path, step: int, books: Bookkeeping, layout: str = "") -> None:
    """Write `complete.json` once every rank's files are in `path`: each rank hashes its share
    of the files (they are in the page cache, just written), rank 0 writes the record."""
    books.barrier()
    files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.endswith(".tmp")
                   and p.name != COMPLETE)
    mine = {n: {"bytes": (path / n).stat().st_size, "sha256": _sha256(path / n)}
            for n in files[books.rank::books.world_size]}
    every: Dict[str, Any] = {}
    for part in books.gather(mine):
        every.update(part)
    if books.rank == 0:
        tmp = path / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"step": step, "world_size": books.world_size,
                                   "layout": layout, "files": every}))
        os.replace(tmp, path / COMPLETE)
    books.barrier()


def problem(path: Path, books: Bookkeeping) -> Optional[str]:
    """None if the checkpoint folder is whole, else why not (every rank checks its share of
    the files, and all agree)."""
    try:
        files = json.loads((path / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        files = None
    why = None if files is not None else "unreadable completion record"
    for name in sorted(files or {})[books.rank::books.world_size]:
        want, f = files[name], path / name
        if not f.exists():
            why = f"{name} missing"
        elif f.stat().st_size != want["bytes"]:
            why = f"{name} truncated ({f.stat().st_size} of {want['bytes']} bytes)"
        elif _sha256(f) != want["sha256"]:
            why = f"{name}: sha256 mismatch (corrupt)"
        if why:
            break
    return next((w for w in books.gather(why) if w), None)


def _extra(path: Path, rank: int) -> Dict[str, Any]:
    """This rank's unsharded state. Another world size has other ranks: rank 0's record
    (which holds the step for everyone) stands in for a missing one."""
    mine = path / _extra_name(rank)
    found = mine if mine.exists() else path / _extra_name(0)
    return torch.load(found, map_location="cpu", weights_only=False) if found.exists() else {}


def read(path: Path, template: Dict[str, Any], books: Bookkeeping) -> Dict[str, Any]:
    """A whole checkpoint folder loaded into `template` (this layout's state dicts, resharded
    by DCP), with this rank's unsharded state."""
    _dcp_io(dcp.load, template, path, books)
    template.update(_extra(path, books.rank))
    return template


class CheckpointDir:
    """The checkpoints of one run in one layout; every rank calls save and load together.
    Keeps the newest `keep`, and every `keep_every`-th step."""

    def __init__(self, folder: Path | str, books: Bookkeeping, keep: int = 2,
                 keep_every: int = 0):
        self.folder, self.books, self.keep = Path(folder), books, keep
        self.keep_every = keep_every
        self._latest: Optional[Tuple[int]] = None  # (the newest whole step,), checked once

    def path(self, step: int) -> Path:
        return self.folder / step_name(step)

    def steps(self) -> List[int]:
        """Steps with a completion record, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(s for p in self.folder.iterdir()
                      if (s := step_of(p)) is not None and (p / COMPLETE).exists())

    def save(self, step: int, state: Dict[str, Any]) -> Path:
        path, books = self.path(step), self.books
        if books.rank == 0 and path.exists():  # a leftover of an interrupted save
            shutil.rmtree(path)
        books.barrier()
        path.mkdir(parents=True, exist_ok=True)
        _dcp_io(dcp.save, {k: state[k] for k in SHARDED if k in state}, path, books)
        extra = {k: v for k, v in state.items() if k not in SHARDED}
        torch.save(extra, path / _extra_name(books.rank))
        seal(path, step, books, str(state.get("layout", "")))
        if books.rank == 0:
            for old in expired(self.steps(), self.keep, self.keep_every):
                shutil.rmtree(self.path(old), ignore_errors=True)
        self._latest = (step,)
        books.barrier()
        return path

    def latest(self) -> Optional[int]:
        """The newest whole checkpoint's step (None: there is none at all), its files checked
        once. Checkpoints that exist but are all damaged are an error: silently restarting
        would discard recorded work."""
        if self._latest is not None:
            return self._latest[0]
        bad = []
        for step in reversed(self.steps()):
            why = problem(self.path(step), self.books)
            if why is None:
                if self.books.rank == 0:
                    for b in bad:
                        print(f"warning: checkpoint {b} skipped; resuming from step {step}",
                              file=sys.stderr)
                self._latest = (step,)
                return step
            bad.append(f"{step_name(step)}: {why}")
        if bad:
            raise InputError(f"checkpoint dir {self.folder}: no valid checkpoint "
                             f"({'; '.join(bad)}); remove them to start over")
        return None

    def verify(self, step: int) -> Optional[str]:
        """None if the checkpoint of `step` is whole, else why not."""
        return problem(self.path(step), self.books)

    def peek(self, key: str) -> Any:
        """`key` of the newest whole checkpoint's unsharded state (None if absent): what a loop
        hook reads before the model is built, to build it in the shapes it was saved with."""
        step = self.latest()
        return None if step is None else _extra(self.path(step), self.books.rank).get(key)

    def load_latest(self, template: Callable[[], Dict[str, Any]]
                    ) -> Optional[Tuple[int, Dict[str, Any]]]:
        """The newest whole checkpoint loaded into `template()` (this layout's state dicts),
        as (step, state); None when there is none."""
        step = self.latest()
        if step is None:
            return None
        return step, read(self.path(step), template(), self.books)
