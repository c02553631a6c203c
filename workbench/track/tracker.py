"""Tracking is a protocol: MLflow on the rank that owns the metric, a null tracker elsewhere.

Metrics are queued and written by a background thread in one `log_batch` per flush, because a
synchronous sqlite write per step (~11 ms) would cost a small model a tenth of its speed. `flush()`
is called before every checkpoint, so a checkpoint never gets ahead of its recorded metrics and a
resumed run can skip steps already logged: no duplicated and no missing steps.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Dict, List, Optional, Protocol

from workbench.config import TrackingConfig


class Tracker(Protocol):
    run_id: Optional[str]

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None: ...
    def log_params(self, params: Dict[str, Any]) -> None: ...
    def set_tags(self, tags: Dict[str, str]) -> None: ...
    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None: ...
    def last_logged_step(self, key: str) -> int: ...
    def flush(self) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """For tracking=none and for every rank that does not own the loss."""

    run_id: Optional[str] = None

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        pass

    def log_params(self, params: Dict[str, Any]) -> None:
        pass

    def set_tags(self, tags: Dict[str, str]) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        pass

    def last_logged_step(self, key: str) -> int:
        return -1

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


def with_retries(fn, *args, attempts: int = 12, **kwargs):
    """Call fn, retrying with jittered exponential backoff while sqlite says it is locked or the
    server is briefly unreachable: many trial processes share one store."""
    delay = 0.05
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps OperationalError; match the text
            text = str(e).lower()
            transient = any(s in text for s in ("locked", "busy", "connection", "timed out",
                                                "temporarily", "503", "502"))
            if not transient or i == attempts - 1:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 2.0)
    return None


class MlflowTracker:
    """Writes one existing MLflow run through MlflowClient (no fluent, process-global run)."""

    def __init__(self, uri: str, run_id: str, flush_every_s: float = 1.0):
        from workbench.track.store import client

        self.client = client(uri)
        self.run_id = run_id
        self._queue: List[tuple] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._error: Optional[BaseException] = None
        self._flush_every_s = flush_every_s
        self._thread = threading.Thread(target=self._worker, name="mlflow-writer", daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        while not self._stop:
            self._wake.wait(self._flush_every_s)
            self._wake.clear()
            try:
                self._drain()
            except BaseException as e:  # surfaced on the next flush()
                self._error = e

    def _drain(self) -> None:
        from mlflow.entities import Metric

        with self._lock:
            items, self._queue = self._queue, []
        if not items:
            return
        ms = [Metric(k, float(v), ts, step) for (k, v, ts, step) in items]
        for i in range(0, len(ms), 900):  # the REST API caps a batch at 1000 metrics
            with_retries(self.client.log_batch, self.run_id, metrics=ms[i:i + 900])

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        with self._lock:
            self._queue.extend((k, v, ts, step) for k, v in metrics.items())

    def log_params(self, params: Dict[str, Any]) -> None:
        from mlflow.entities import Param

        ps = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(ps), 90):
            with_retries(self.client.log_batch, self.run_id, params=ps[i:i + 90])

    def set_tags(self, tags: Dict[str, str]) -> None:
        from mlflow.entities import RunTag

        with_retries(self.client.log_batch, self.run_id,
                     tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str, artifact_path: Optional[str] = None) -> None:
        with_retries(self.client.log_artifact, self.run_id, path, artifact_path)

    def last_logged_step(self, key: str) -> int:
        """Highest step already recorded for `key` (-1 if none): a resumed run logs after it."""
        hist = with_retries(self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in hist), default=-1)

    def flush(self) -> None:
        self._drain()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self, status: str = "FINISHED") -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._drain()
        with_retries(self.client.set_terminated, self.run_id, status)


def make_tracker(cfg: TrackingConfig, run_id: Optional[str], owns_metrics: bool) -> Tracker:
    if cfg.backend == "none" or not owns_metrics or not run_id:
        return NullTracker()
    return MlflowTracker(cfg.resolved_uri(), run_id)


def create_run(cfg: TrackingConfig, run_name: str, tags: Dict[str, str],
               parent_run_id: Optional[str] = None) -> Optional[str]:
    """Create the MLflow run for a job before any rank starts (so a job file names its run).
    A store that cannot be created or reached is one line of bad input (InputError)."""
    if cfg.backend == "none":
        return None
    from workbench.track.store import client, tracking_errors

    uri = cfg.resolved_uri()
    c = client(uri)
    with tracking_errors(uri):
        exp = with_retries(c.get_experiment_by_name, cfg.experiment)
        if exp is None:
            try:
                exp_id = with_retries(c.create_experiment, cfg.experiment)
            except Exception:  # created meanwhile by a concurrent process
                exp_id = with_retries(c.get_experiment_by_name, cfg.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        if parent_run_id:
            tags = {**tags, "mlflow.parentRunId": parent_run_id}
        run = with_retries(c.create_run, exp_id, tags=tags, run_name=run_name)
    return run.info.run_id


def reading_client(uri: str) -> Any:
    """An MLflow client for a command that only reads (report, rerun): a sqlite store that does
    not exist is bad input, not a new empty store to create (and log about)."""
    from pathlib import Path

    from workbench.cli import InputError
    from workbench.track.store import client

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise InputError(f"tracking uri {uri!r}: no MLflow store there (run from the folder "
                         "that holds mlflow.db, or set MLFLOW_TRACKING_URI / tracking.uri)")
    return client(uri, create=False)
