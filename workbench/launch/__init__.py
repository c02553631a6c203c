"""Launchers: how the ranks of a job start. Each ends in `python -m workbench.train JOB_FILE`."""

from __future__ import annotations

from typing import Dict, Protocol

from workbench.config import LauncherConfig
from workbench.job import Job


class RanksFailed(RuntimeError):
    """The ranks of a job exited with an error; their own logs say why."""


class Launcher(Protocol):
    def world_size(self) -> int: ...
    def launch(self, job: Job) -> Dict[str, float]: ...


def world_size(cfg: LauncherConfig) -> int:
    """How many ranks a launcher config starts: the one place this is computed (the run, the
    sweep driver and every launcher ask here)."""
    if cfg.name == "slurm":
        return cfg.nodes * cfg.tasks_per_node
    if cfg.name == "torchrun":
        return cfg.nodes * cfg.nproc_per_node
    return 1


def make_launcher(cfg: LauncherConfig) -> Launcher:
    if cfg.name == "local":
        from workbench.launch.local import LocalLauncher

        return LocalLauncher()
    if cfg.name == "torchrun":
        from workbench.launch.torchrun import TorchrunLauncher

        return TorchrunLauncher(cfg)
    from workbench.launch.slurm import SlurmLauncher

    return SlurmLauncher(cfg)
