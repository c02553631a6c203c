"""How checkpoints are named, in one place.

A run's checkpoints live in `RUN/checkpoints/<layout key>/step_NNNNNNNN/`, one
torch.distributed.checkpoint folder per step (the step the run continues from), whatever the
world size. Runs of older versions wrote one process's checkpoints as whole files,
`RUN/checkpoints/step_NNNNNNNN.pt` with a `.json` sidecar of its size and sha256 (legacy.py
reads them). No torch here: the driver resolves `train.init_from` with these names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional

CHECKPOINTS = "checkpoints"
COMPLETE = "complete.json"  # written last: a folder without it is not a checkpoint
WHOLE_SUFFIX = ".pt"
_STEP = re.compile(r"^step_(\d{8})(\.pt)?$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path | str) -> Optional[int]:
    """The step a checkpoint folder (or an old whole file) is named for; None for any other
    name."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_whole_file(path: Path | str) -> bool:
    return Path(path).suffix == WHOLE_SUFFIX


def layout_folder(run_dir: Path | str, layout_key: str) -> Path:
    return Path(run_dir) / CHECKPOINTS / layout_key


def whole_files(run_dir: Path | str) -> List[Path]:
    """The whole-file checkpoints of a run written by an older version, oldest first."""
    base = Path(run_dir) / CHECKPOINTS
    return sorted(p for p in base.glob(f"step_*{WHOLE_SUFFIX}") if step_of(p) is not None)


def in_any_layout(path: Path) -> Optional[Path]:
    """`RUN/checkpoints/step_N` names step N's checkpoint folder in whichever layout folder
    holds it (the layout is how it was written, not which checkpoint it is); None when none
    or several do."""
    if path.parent.name != CHECKPOINTS or step_of(path) is None or is_whole_file(path):
        return None
    found = [p for p in path.parent.glob(f"*/{path.name}") if p.is_dir()]
    return found[0] if len(found) == 1 else None


def step_folders(run_dir: Path | str) -> List[Path]:
    """Every checkpoint folder of a run, in any layout it ran in, complete or not."""
    base = Path(run_dir) / CHECKPOINTS
    return [p for p in base.glob("*/step_*") if p.is_dir() and step_of(p) is not None]


def sidecar(whole_file: Path) -> Path:
    return whole_file.with_suffix(".json")


def looks_complete(whole_file: Path) -> bool:
    """An old whole file whose sidecar was written (it came after the file) and which has the
    size the sidecar gives: what can be known without reading it. Its hash is checked when it
    is read, once (legacy.read_verified)."""
    try:
        side = json.loads(sidecar(whole_file).read_text())
    except (OSError, ValueError):
        return False
    return whole_file.exists() and whole_file.stat().st_size == side.get("bytes")


def newest_whole_file(run_dir: Path | str) -> Optional[Path]:
    """The newest whole-file checkpoint of an older version's run folder that looks complete."""
    return next((p for p in reversed(whole_files(run_dir)) if looks_complete(p)), None)
