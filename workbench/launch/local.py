"""The local launcher: one rank on this machine. `workbench.run` trains it in its own process
(no second interpreter to start); a sweep's local trials run in the background, as processes
of their own (launch.process), so that several run at once and outlive the driver."""

from __future__ import annotations

import subprocess
from typing import Dict

from workbench.config import LauncherConfig
from workbench.job import Job
from workbench.launch.process import start_ranks


class LocalLauncher:
    def __init__(self, cfg: LauncherConfig):
        self.cfg = cfg

    def world_size(self) -> int:
        return 1

    def launch(self, job: Job) -> Dict[str, float]:
        return job.run_on_this_rank()  # torch loads only when this process runs a rank

    def start(self, job: Job) -> subprocess.Popen:
        """The job's rank in the background (a sweep's trial)."""
        return start_ranks(self.cfg, job)
