"""Multi-rank checkpoints with torch.distributed.checkpoint (DCP), whole or ignored.

`step_NNNNNNNN/` holds the DCP shards of the model and optimizer (keyed by parameter name, so a
checkpoint written by one layout loads into another: DCP reshards on load), one small file per
rank with what is per-rank (RNG state, step), and last a `complete.json` that rank 0 writes after
every rank has finished. A folder without it (a run killed mid-save) is skipped on load.
It has the interface of `whole.CheckpointDir`, so the loop does not know which it has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from workbench.train.checkpoint.whole import expired

_NAME = re.compile(r"step_(\d{8})$")
_SHARDED = ("model", "optimizer")
DONE = "complete.json"


class DistCheckpointDir:
    """The checkpoints of one multi-rank run; every rank calls save/load together."""

    def __init__(self, folder: Path | str, keep: int = 2, rank: int = 0, keep_every: int = 0):
        self.folder, self.keep, self.rank = Path(folder), keep, rank
        self.keep_every = keep_every

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}"

    def steps(self) -> List[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir()
                      if (m := _NAME.match(p.name)) and (p / DONE).exists())

    def save(self, step: int, state: Dict[str, Any]) -> Path:
        path = self.path(step)
        if self.rank == 0 and path.exists():  # a leftover of an interrupted save
            shutil.rmtree(path)
        dist.barrier()
        dcp.save({k: state[k] for k in _SHARDED}, checkpoint_id=str(path))
        extra = {k: v for k, v in state.items() if k not in _SHARDED}
        torch.save(extra, path / f"extra_rank{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            tmp = path / f".{DONE}.tmp"
            tmp.write_text(json.dumps({"step": step, "world_size": dist.get_world_size(),
                                       "layout": state.get("layout", "")}))
            os.replace(tmp, path / DONE)
            for old in expired(self.steps(), self.keep, self.keep_every):
                shutil.rmtree(self.path(old), ignore_errors=True)
        dist.barrier()
        return path

    def _extra_path(self, step: int) -> Path:
        """This rank's record of what is not sharded; another world size has other ranks, so
        rank 0's record (which holds the step for everyone) stands in for a missing one."""
        mine = self.path(step) / f"extra_rank{self.rank:05d}.pt"
        return mine if mine.exists() else self.path(step) / "extra_rank00000.pt"

    def peek(self, key: str) -> Any:
        """`key` of the newest complete checkpoint's unsharded state (None if absent)."""
        steps = self.steps()
        if not steps:
            return None
        return torch.load(self._extra_path(steps[-1]), map_location="cpu",
                          weights_only=False).get(key)

    def load_latest(self, template: Optional[Callable[[], Dict[str, Any]]] = None
                    ) -> Optional[Tuple[int, Dict[str, Any]]]:
        """Load the newest complete checkpoint into `template()` (this layout's state dicts,
        resharded by DCP); None when there is none."""
        steps = self.steps()
        if not steps:
            return None
        assert template is not None, "a sharded checkpoint loads into a template"
        step = steps[-1]
        path = self.path(step)
        state = template()
        dcp.load(state, checkpoint_id=str(path))
        state.update(torch.load(self._extra_path(step), map_location="cpu", weights_only=False))
        return step, state
