"""The torchrun launcher: N local processes through `torch.distributed.run --standalone`.

Every rank runs the same entry point with the same job file as the local launcher
(`python -m workbench.train JOB_FILE`), started by `launch.process`, the one way ranks start as
processes on this machine (a sweep's local trials start there too). gloo on CPU, NCCL on GPUs:
the rank entry picks the backend from the job's cluster.device.
"""

from __future__ import annotations

import subprocess
from typing import Dict

from workbench.config import LauncherConfig
from workbench.errors import ConfigError
from workbench.job import Job
from workbench.launch.process import run_ranks, start_ranks
from workbench.launch.world import world_size


class TorchrunLauncher:
    def __init__(self, cfg: LauncherConfig):
        if cfg.nodes != 1:
            raise ConfigError("launcher.nodes", cfg.nodes,
                              "torchrun --standalone is one node; use launcher=slurm for more")
        self.cfg = cfg

    def world_size(self) -> int:
        return world_size(self.cfg)

    def launch(self, job: Job) -> Dict[str, float]:
        """Run the job to completion; the final metrics of the loss-holding rank."""
        return run_ranks(self.cfg, job)

    def start(self, job: Job) -> subprocess.Popen:
        """The job's ranks in the background (a sweep's trial)."""
        return start_ranks(self.cfg, job)
