"""The torchrun launcher: N local processes through `torch.distributed.run --standalone`.

Every rank runs the same entry point with the same job file as the local launcher
(`python -m workbench.train JOB_FILE`); the rank that holds the loss writes
`run_dir/final_metrics.json`, which this launcher returns. gloo on CPU, NCCL on GPUs: the rank
entry picks the backend from the job's cluster.device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from workbench.config import LauncherConfig
from workbench.job import FINAL_METRICS, Job
from workbench.launch.world import RanksFailed, world_size


def command(nproc_per_node: int, job_path: Path | str) -> List[str]:
    """The one torchrun command line (this launcher and the sweep's process backend)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nnodes", "1", "--nproc_per_node", str(nproc_per_node),
            "-m", "workbench.train", str(job_path)]


class TorchrunLauncher:
    def __init__(self, cfg: LauncherConfig):
        self.cfg = cfg

    def world_size(self) -> int:
        return world_size(self.cfg)

    def launch(self, job: Job) -> Dict[str, float]:
        """Run the job to completion; the final metrics of the loss-holding rank."""
        if self.cfg.nodes != 1:
            from workbench.errors import ConfigError

            raise ConfigError("launcher.nodes", self.cfg.nodes,
                              "torchrun --standalone is one node; use launcher=slurm for more")
        result = Path(job.run_dir) / FINAL_METRICS
        result.unlink(missing_ok=True)
        env = dict(os.environ)
        # The ranks share the node's cores: train.threads each (resolved in the job file), set
        # before any rank starts torch, so each OpenMP pool starts at its share.
        threads = job.run_config().train.threads
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        else:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                      // self.cfg.nproc_per_node)))
        proc = subprocess.run(command(self.cfg.nproc_per_node, job.path), env=env)
        if proc.returncode != 0:
            raise RanksFailed(f"torchrun job {job.path} failed: the ranks exited with status "
                              f"{proc.returncode} (their errors are printed above)")
        if not result.exists():
            raise RanksFailed(f"torchrun job {job.path} exited 0 but wrote no {FINAL_METRICS}")
        return json.loads(result.read_text())

