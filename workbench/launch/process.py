"""A job's ranks as processes on this machine: the one command line and environment that the
torchrun launcher starts in the foreground (`workbench.run` waits for it) and that a sweep's
local trials start in the background (each in its own session, so a killed or detached driver
leaves them running and a later driver finds them by pid).

Several ranks run under `torch.distributed.run --standalone`; one rank is the rank entry itself.
Either way the process is `... -m workbench.train JOB_FILE` (a profile job's worker for a
profile), and the loss-holding rank writes `run_dir/final_metrics.json`, which is how a
foreground launch gets its result back (this driver never imports the rank code, nor torch).
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
from workbench.launch.world import RanksFailed, cores


def command(cfg: LauncherConfig, job: Job) -> List[str]:
    """torchrun over the node's ranks for several ranks, the rank entry itself for one."""
    train = ["-m", job.command_module(), str(job.path)]
    if job.world_size <= 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(cfg.nproc_per_node), *train]


def environment(job: Job) -> Dict[str, str]:
    """The ranks share the node's cores: train.threads each (resolved in the job file: a sweep
    gives concurrent trials their share), set before any rank starts torch, so each OpenMP pool
    starts at its size; unresolved, several ranks split the cores and one keeps torch's own."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    threads = job.run_config().train.threads
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    elif job.world_size > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores() // job.world_size)))
    return env


def start_ranks(cfg: LauncherConfig, job: Job) -> subprocess.Popen:
    """The job's ranks in the background, in a session of their own, logging to
    run_dir/train.log: they outlive the process that started them."""
    with open(Path(job.run_dir) / "train.log", "ab") as log:
        return subprocess.Popen(command(cfg, job), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=environment(job))


def run_ranks(cfg: LauncherConfig, job: Job) -> Dict[str, float]:
    """The job's ranks in the foreground (their output on this terminal, Ctrl-C reaches them),
    to completion; the final metrics of the loss-holding rank."""
    result = Path(job.run_dir) / FINAL_METRICS
    result.unlink(missing_ok=True)
    proc = subprocess.run(command(cfg, job), env=environment(job))
    if proc.returncode != 0:
        raise RanksFailed(f"job {job.path} failed: its ranks exited with status "
                          f"{proc.returncode} (their errors are printed above)")
    if not result.exists():
        raise RanksFailed(f"job {job.path} exited 0 but wrote no {FINAL_METRICS}")
    return json.loads(result.read_text())
