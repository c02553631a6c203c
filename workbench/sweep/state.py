"""The durable state of one sweep, in `sweeps/NAME/`: the driver can die at any line and a
resumed driver continues without losing a trial or running one twice.

  plan.json     what the sweep is: its config, the base overrides and the resolved base config
                every trial starts from, the parent MLflow run
  study.log     the Optuna 5 journal storage (safe for many concurrent writers), unless
                `sweep.storage` names an RDB (PostgreSQL for workers on many nodes)
  trials.json   the trial -> job map: one record per Optuna trial, advanced through
                asked -> prepared -> submitted -> complete | failed, or asked -> rejected
  rejected.json the layouts the cost model rejected, with reasons (also a parent-run artifact)
  trials/NNNN/  each trial's run folder (job file, checkpoints, logs)
  slurm/        submitit's pickles and Slurm logs of the arrays
  driver.lock   flock held by the running driver: two drivers never advance one sweep
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import InputError

STATES = ("asked", "rejected", "prepared", "submitted", "complete", "failed")
DONE = ("rejected", "complete", "failed")


@dataclass
class TrialRecord:
    number: int
    status: str = "asked"
    params: dict[str, Any] = field(default_factory=dict)
    layout: str = ""
    run_dir: str = ""
    run_id: str | None = None
    job_id: str = ""  # Slurm "ARRAY_TASK" id, or the local process id
    reason: str = ""  # why rejected or failed
    values: list[float] = field(default_factory=list)
    pred: dict[str, float] = field(default_factory=dict)
    told: bool = False  # Optuna has this trial's final state
    attempts: int = 0  # submissions (a vanished local trial is resubmitted and resumes)


def write_json(path: Path, data: Any) -> None:
    """Atomic: a reader (or a resumed driver) sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_study(where: Path | str, name: str, directions: Sequence[str], sampler: Any = None):
    """The sweep's Optuna study: in a journal file (a path: file locks, many processes on one
    machine may write) or in an RDB every worker reaches (a URL, `sweep.storage`: PostgreSQL on
    a cluster). An RDB that cannot be opened is one line of bad input."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if isinstance(where, str) and "://" in where:
        try:
            storage: Any = optuna.storages.RDBStorage(where)
        except Exception as e:  # sqlalchemy: driver missing, refused, bad credentials
            from workbench.track.store import redact

            first = " ".join(str(e).split("\n")[0].split())[:200]
            raise InputError(f"sweep.storage={redact(where)!r}: cannot open the Optuna "
                             f"storage ({type(e).__name__}: {first})") from None
    else:
        storage = JournalStorage(JournalFileBackend(str(where)))
    return optuna.create_study(study_name=name, storage=storage, directions=list(directions),
                               sampler=sampler, load_if_exists=True)


class SweepState:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.plan_path = self.folder / "plan.json"
        self.trials_path = self.folder / "trials.json"
        self.study_path = self.folder / "study.log"  # Optuna journal storage
        self.rejected_path = self.folder / "rejected.json"
        self.trials: dict[int, TrialRecord] = {}
        self.plan: dict[str, Any] = {}
        self._lock_fd: int | None = None

    def exists(self) -> bool:
        return self.plan_path.exists()

    @classmethod
    def load(cls, folder: Path) -> SweepState:
        state = cls(folder)
        if not state.exists():
            raise InputError(f"no sweep state in {folder} (plan.json missing)")
        state.plan = json.loads(state.plan_path.read_text())
        if state.trials_path.exists():
            raw = json.loads(state.trials_path.read_text())
            state.trials = {int(k): TrialRecord(**v) for k, v in raw.items()}
        return state

    def create(self, plan: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.plan = plan
        write_json(self.plan_path, plan)
        self.save()

    def save_plan(self) -> None:
        write_json(self.plan_path, self.plan)

    def save(self) -> None:
        write_json(self.trials_path, {str(n): asdict(r) for n, r in sorted(self.trials.items())})
        rejected = [{"trial": r.number, "params": r.params, "layout": r.layout,
                     "reason": r.reason, "pred": r.pred}
                    for r in self.trials.values() if r.status == "rejected"]
        write_json(self.rejected_path, rejected)

    def update(self, record: TrialRecord, save: bool = True, **changes: Any) -> TrialRecord:
        """Change one record and persist the map before anything else happens (save=False for
        a batch of cheap changes that the caller saves once, e.g. a round of rejections)."""
        for key, value in changes.items():
            setattr(record, key, value)
        self.trials[record.number] = record
        if save:
            self.save()
        return record

    # ------------------------------------------------------------------ lock
    def lock(self) -> None:
        """Hold the driver lock for this process's lifetime (released by the OS if killed)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / "driver.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(f"another sweep driver is running on {self.folder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ queries
    def with_status(self, *statuses: str) -> list[TrialRecord]:
        return [r for n, r in sorted(self.trials.items()) if r.status in statuses]

    def in_flight(self) -> list[TrialRecord]:
        return self.with_status("asked", "prepared", "submitted")

    def trial_dir(self, number: int) -> Path:
        return (self.folder / "trials" / f"{number:04d}").resolve()
