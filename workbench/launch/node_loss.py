"""A node lost in the middle of a multi-node Slurm job: what the ranks that survive it do.

When one node of a job dies (its slurmd, slurmstepd and ranks gone), the ranks on the other nodes
see their collectives fail at once ("Connection closed by peer"), but Slurm learns of the loss
only after SlurmdTimeout, marks the node DOWN and then requeues the batch job (NODE_FAIL; batch
jobs are requeueable by default). If a surviving rank 0 simply raised, submitit would record its
error as the job's result before Slurm requeues, and the user would see a failure instead of a
job that resumes from its checkpoint. So a surviving rank of a multi-node job whose collective
failed waits for Slurm's verdict instead: it names the node that stopped answering (one line)
and lets the requeue end it; when no requeue comes in SlurmdTimeout plus a margin, it fails
with one line naming the node and how to resume. A rank whose own code fails raises at once,
and srun's `--kill-on-bad-exit` (launch/slurm.sbatch_parameters) ends its peers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Optional

# What gloo (and NCCL's socket transport) raise when a peer's process or host is gone.
PEER_GONE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|"
                       r"timed? ?out|no route to host|network is unreachable|socket closed",
                       re.I)
MARGIN_S = 40.0  # after SlurmdTimeout: Slurm's node ping round and its requeue of the job
POLL_S = 2.0


def peer_lost(exc: BaseException) -> bool:
    """Did a collective fail because a peer went away (not because this rank's code failed)?"""
    import torch.distributed as dist

    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, (dist.DistError, RuntimeError)) and bool(PEER_GONE.search(text))


def _slurm(*args: str) -> str:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=20,
                              check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def slurmd_timeout_s() -> float:
    """The cluster's SlurmdTimeout: how long Slurm waits before it calls a silent node DOWN."""
    found = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", _slurm("scontrol", "show", "config"), re.M)
    return float(found.group(1)) if found else 300.0


def silent_nodes(nodelist: str) -> list[str]:
    """The nodes of `nodelist` Slurm reports as not responding or down ('*' or down/fail)."""
    out = _slurm("sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %T")
    bad = []
    for line in out.splitlines():
        name, _, state = line.partition(" ")
        if state.endswith("*") or state.startswith(("down", "fail", "drain")):
            bad.append(f"{name} ({state})")
    return sorted(set(bad))


def wait_for_requeue(rank: int, exc: BaseException, run_dir: str,
                     timeout_s: Optional[float] = None) -> None:
    """Wait for Slurm to requeue this job after a lost node (its requeue ends this process);
    raise SystemExit with one line if no requeue comes in time."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    timeout_s = slurmd_timeout_s() + MARGIN_S if timeout_s is None else timeout_s
    print(f"rank {rank}: a peer is gone ({type(exc).__name__}: {str(exc).splitlines()[0][:160]});"
          f" waiting up to {timeout_s:.0f} s for Slurm to requeue the job", file=sys.stderr,
          flush=True)
    deadline, named = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        bad = silent_nodes(nodelist) if nodelist else []
        if bad and not named:
            print(f"rank {rank}: node lost: {', '.join(bad)}; Slurm requeues the job and it "
                  "resumes from its last checkpoint", file=sys.stderr, flush=True)
            named = True
        time.sleep(POLL_S)
    bad = silent_nodes(nodelist) if nodelist else []
    where = (f"node {', '.join(bad)} lost" if bad
             else "every node still answers: a rank failed, see its log")
    raise SystemExit(f"rank {rank}: the job lost a peer ({where}) and Slurm did not requeue it "
                     f"in {timeout_s:.0f} s; resume with: python -m workbench.run "
                     f"train.run_dir={run_dir}")
