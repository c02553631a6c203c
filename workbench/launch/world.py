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


def cores() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(cfg: LauncherConfig, requested: int = 0, concurrent: int = 1) -> int:
    """The intra-op threads each rank of a job runs with, recorded in the run as train.threads.

    As asked (`train.threads=N`: a run started by hand beside others takes its share), else the
    cores shared by the ranks of `concurrent` jobs running at once, so that concurrent local runs
    share the cores instead of each spinning one thread per core. One job alone keeps what torch
    would pick ($OMP_NUM_THREADS, else torch's default). Slurm: 0, the task's CPU allocation
    decides on the node (launch/slurm.py)."""
    import os

    if requested > 0:
        return requested
    if cfg.name == "slurm":
        return 0
    ranks = cfg.nproc_per_node if cfg.name == "torchrun" else 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if concurrent <= 1 and omp.isdigit() and int(omp) > 0:
        return int(omp)
    if concurrent <= 1 and ranks == 1:
        import torch

        return torch.get_num_threads()
    return max(1, cores() // (ranks * max(1, concurrent)))
