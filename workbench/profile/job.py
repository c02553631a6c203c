"""A profile as a job: written as a job file of kind `profile` and started by the run's own
launcher, so its ranks land where a training job's would (one process, torchrun's processes,
Slurm's tasks on their nodes) and time the links those ranks use."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

from workbench.config import RunConfig
from workbench.errors import InputError
from workbench.job import Job, config_dict
from workbench.launch import make_launcher, world_size
from workbench.layout import Layout
from workbench.profile.spec import ProfileSpec

RESULT = "profile.json"  # what rank 0 writes into the job's folder (profile/worker.py)


def profile_job(cfg: RunConfig, spec: ProfileSpec, work: Path, world: int = 0) -> Job:
    """The job file of a profile over `world` ranks (0: as many as the launcher starts)."""
    world = world or world_size(cfg.launcher)
    job = Job(config=config_dict(cfg), layout=Layout(dp_replicate=world).key(),
              run_dir=str(work), world_size=world, kind="profile", task=asdict(spec))
    job.save()
    return job


def result(work: Path) -> Dict[str, Any]:
    """Rank 0's measurements, as plain data."""
    path = work / RESULT
    if not path.exists():
        raise InputError(f"the profile job in {work} ended without writing {RESULT}")
    return json.loads(path.read_text())


def launch_profile(cfg: RunConfig, spec: ProfileSpec, work: Path) -> Dict[str, Any]:
    """Run the profile on the launcher's ranks; rank 0's measurements."""
    make_launcher(cfg.launcher).launch(profile_job(cfg, spec, work))
    return result(work)
