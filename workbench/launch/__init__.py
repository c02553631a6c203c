"""Launchers: how the ranks of a job start. Each ends in `python -m workbench.train JOB_FILE`.

`launch` runs a job to its end (`workbench.run`); a sweep starts many without waiting: local and
torchrun trials through their launcher's `start` (background processes, launch.process), Slurm
trials as one array through `SlurmLauncher.submit_array`."""

from __future__ import annotations

from typing import Dict, Protocol

from workbench.config import LauncherConfig
from workbench.job import Job
from workbench.launch.world import RanksFailed, threads_per_rank, world_size

__all__ = ["Launcher", "RanksFailed", "make_launcher", "threads_per_rank", "world_size"]


class Launcher(Protocol):
    def world_size(self) -> int: ...
    def launch(self, job: Job) -> Dict[str, float]: ...


def make_launcher(cfg: LauncherConfig) -> Launcher:
    if cfg.name == "local":
        from workbench.launch.local import LocalLauncher

        return LocalLauncher(cfg)
    if cfg.name == "torchrun":
        from workbench.launch.torchrun import TorchrunLauncher

        return TorchrunLauncher(cfg)
    from workbench.launch.slurm import SlurmLauncher

    return SlurmLauncher(cfg)
