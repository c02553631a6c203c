"""How a sweep's trials run: as one Slurm job array per round, or as local processes, started
by the launchers (launch/slurm.py's arrays, launch/process.py's background ranks): a sweep has no
way of starting ranks of its own.

A backend only starts trials and says whether one has ended. Whether it succeeded, and its
measured objectives, come from its MLflow run, which the trial itself closes: the run, not the
launcher, is the record, so `collect` after `detach` and a resumed driver read the same truth.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from workbench.config import RunConfig
from workbench.job import Job
from workbench.launch import make_launcher
from workbench.sweep.state import TrialRecord

# sacct states after which a Slurm job will not run again (REQUEUED/PENDING are not final).
SLURM_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED")
# ... except when Slurm requeued the job: sacct then shows the attempt that died while the job
# waits in the queue again (a lost node, launch/node_loss; a preemption with PreemptMode=REQUEUE)
MAYBE_REQUEUED = ("NODE_FAIL", "PREEMPTED")


class Backend(Protocol):
    def submit(self, records: Sequence[TrialRecord], jobs: Sequence[Job]) -> list[str]: ...
    def ended(self, records: Sequence[TrialRecord]) -> dict[int, str]: ...
    def wait_slots(self) -> int: ...
    def requeued(self, record: TrialRecord) -> bool: ...


class Starts(Protocol):
    """A launcher that starts a job's ranks in the background (local, torchrun)."""

    def start(self, job: Job) -> subprocess.Popen: ...


class SlurmBackend:
    """Each round's survivors as one job array (one sbatch), at most `parallelism` at once."""

    def __init__(self, cfg: RunConfig, folder: Path, name: str, parallelism: int):
        from workbench.launch.slurm import SlurmLauncher

        self.launcher = SlurmLauncher(cfg.launcher)
        self.folder, self.name, self.parallelism = folder, name, parallelism

    def submit(self, records: Sequence[TrialRecord], jobs: Sequence[Job]) -> list[str]:
        handles = self.launcher.submit_array(jobs, self.folder, f"wb-sweep-{self.name}",
                                             self.parallelism)
        return [h.job_id for h in handles]

    def ended(self, records: Sequence[TrialRecord]) -> dict[int, str]:
        """{trial: final Slurm state} for the trials whose job will not run again."""
        ids = [r.job_id for r in records if r.job_id]
        if not ids:
            return {}
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                             capture_output=True, text=True, timeout=60, check=False)
        states: dict[str, str] = {}
        for line in out.stdout.splitlines():
            job_id, _, state = line.partition("|")
            states[job_id] = state.split()[0] if state else ""
        from workbench.launch.slurm import still_queued

        return {r.number: states[r.job_id] for r in records
                if states.get(r.job_id, "") in SLURM_FINAL
                and not (states[r.job_id] in MAYBE_REQUEUED and still_queued(r.job_id))}

    def wait_slots(self) -> int:
        return 1 << 30  # Slurm queues the whole array; the driver never throttles it

    def requeued(self, record: TrialRecord) -> bool:
        """Is the trial's job in Slurm's queue again though its run was closed FAILED? A rank
        whose peer was lost with its node closes the run before Slurm requeues the job; the
        next attempt resumes that same run (launch/node_loss)."""
        from workbench.launch.slurm import still_queued

        return bool(record.job_id) and still_queued(record.job_id)


class ProcessBackend:
    """launcher=local or torchrun: each trial's ranks started in the background by its launcher
    (launch.process: a session of their own, so a killed or detached driver leaves its trials
    running and a later driver finds them by pid)."""

    def __init__(self, launcher: Starts, parallelism: int):
        self.launcher, self.parallelism = launcher, parallelism
        self._procs: dict[int, subprocess.Popen] = {}

    def submit(self, records: Sequence[TrialRecord], jobs: Sequence[Job]) -> list[str]:
        ids = []
        for record, job in zip(records, jobs):
            proc = self.launcher.start(job)
            self._procs[record.number] = proc
            ids.append(f"pid:{proc.pid}")
        return ids

    def ended(self, records: Sequence[TrialRecord]) -> dict[int, str]:
        out = {}
        for r in records:
            proc = self._procs.get(r.number)
            if proc is not None:
                code = proc.poll()
                if code is not None:
                    out[r.number] = f"exit {code}"
            elif not _pid_alive(r.job_id):  # started by an earlier driver
                out[r.number] = "gone"
        return out

    def wait_slots(self) -> int:
        running = sum(1 for p in self._procs.values() if p.poll() is None)
        return max(0, self.parallelism - running)

    def requeued(self, record: TrialRecord) -> bool:
        return False  # local processes are never started again by anyone but the driver


def _pid_alive(job_id: str) -> bool:
    if not job_id.startswith("pid:"):
        return False
    pid = int(job_id[4:])
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a reused pid is not our trial: it must be running workbench.train
        return b"workbench.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def make_backend(cfg: RunConfig, folder: Path, name: str, parallelism: int) -> Backend:
    """The trials' way to start: the launcher's own (its config checked here, before the sweep
    records anything)."""
    if cfg.launcher.name == "slurm":
        return SlurmBackend(cfg, folder / "slurm", name, parallelism)
    return ProcessBackend(make_launcher(cfg.launcher), parallelism)  # type: ignore[arg-type]
