"""The local launcher: this process is the only rank (world size 1)."""

from __future__ import annotations

from typing import Dict

from workbench.job import Job


class LocalLauncher:
    def world_size(self) -> int:
        return 1

    def launch(self, job: Job) -> Dict[str, float]:
        from workbench.rank import run_job

        return run_job(job)
