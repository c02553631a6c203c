"""What every launcher shares and the driver asks before launching: how many ranks a launcher
config starts, and how a failed set of ranks is reported."""

from __future__ import annotations

from workbench.config import LauncherConfig


class RanksFailed(RuntimeError):
    """The ranks of a job exited with an error; their own logs say why."""


def world_size(cfg: LauncherConfig) -> int:
    """How many ranks a launcher config starts: the one place this is computed (the run, the
    sweep driver and every launcher ask here)."""
    if cfg.name == "slurm":
        return cfg.nodes * cfg.tasks_per_node
    if cfg.name == "torchrun":
        return cfg.nodes * cfg.nproc_per_node
    return 1
