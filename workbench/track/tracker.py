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


# Transient: sqlite says it is locked, or the server is unreachable or restarting. The texts are
# what MlflowException carries: requests' "Max retries exceeded ... [Errno 111] Connection
# refused" while the server is down, "Connection aborted" / "RemoteDisconnected" when it dies
# mid-request, 502/503/504 from a proxy or a database deadlock.
TRANSIENT = ("locked", "busy", "connection", "max retries", "timed out", "temporarily",
             "remotedisconnected", "reset by peer", "503", "502", "504")


def retry_window_s() -> float:
    """How long a tracking call keeps retrying transient errors: WORKBENCH_TRACKING_RETRY_S,
    default 300 s, so a server restart (15-30 s) or a database failover loses nothing."""
    import os

    try:
        return max(0.0, float(os.environ.get("WORKBENCH_TRACKING_RETRY_S", "300")))
    except ValueError:
        return 300.0


def with_retries(fn, *args, attempts: int = 12, **kwargs):
    """Call fn, retrying with jittered exponential backoff (capped at 5 s) while the error is
    transient (TRANSIENT): many trial processes share one store, and a tracking server can be
    restarted under a running job. At least `attempts` tries, and more until retry_window_s()
    has passed since the first. (MLflow's own HTTP client already retries a refused connection
    for about 4 minutes inside one call; this covers what surfaces past it.)"""
    delay, deadline = 0.05, time.monotonic() + retry_window_s()
    i = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps OperationalError; match the text
            text = str(e).lower()
            i += 1
            if not any(s in text for s in TRANSIENT) or \
                    (i >= attempts and time.monotonic() >= deadline):
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 5.0)


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
        self._send_lock = threading.Lock()  # one batch in flight: flush() waits for it
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
        """Send what is queued. A batch that fails for good goes back to the front of the queue
        (the next flush or close sends it again; the server drops a metric it already has, same
        key, step, value and timestamp), so an outage loses no metric and duplicates no step."""
        from mlflow.entities import Metric

        with self._send_lock:
            with self._lock:
                items, self._queue = self._queue, []
            for i in range(0, len(items), 900):  # the REST API caps a batch at 1000 metrics
                ms = [Metric(k, float(v), ts, step) for (k, v, ts, step) in items[i:i + 900]]
                try:
                    with_retries(self.client.log_batch, self.run_id, metrics=ms)
                except BaseException:
                    with self._lock:
                        self._queue[:0] = items[i:]
                    raise

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
        """Send everything queued before returning (a checkpoint follows). A batch the writer
        thread failed to send went back to the queue, so it is sent here or this raises."""
        self._drain()
        self._error = None

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
        exp_id = experiment_id(c, uri, cfg.experiment)
        if parent_run_id:
            tags = {**tags, "mlflow.parentRunId": parent_run_id}
        run = with_retries(c.create_run, exp_id, tags=tags, run_name=run_name)
    _artifact_uris[run.info.run_id] = run.info.artifact_uri
    return run.info.run_id


_experiment_ids: Dict[tuple, str] = {}
_artifact_uris: Dict[str, str] = {}  # of the runs this process created (create_run)


def experiment_id(c: Any, uri: str, name: str) -> str:
    """The id of experiment `name`, created if missing; remembered per process (an experiment
    id never changes), so a sweep driver creating 64 runs asks the server once, not 64 times."""
    key = (uri, name)
    if key not in _experiment_ids:
        exp = with_retries(c.get_experiment_by_name, name)
        if exp is None:
            try:
                _experiment_ids[key] = with_retries(c.create_experiment, name)
            except Exception:  # created meanwhile by a concurrent process
                _experiment_ids[key] = with_retries(c.get_experiment_by_name, name).experiment_id
        else:
            _experiment_ids[key] = exp.experiment_id
    return _experiment_ids[key]


def record_prepared(uri: str, run_id: str, params: Dict[str, Any], metrics: Dict[str, float],
                    files: List[Any], artifact_path: str) -> None:
    """Write a just-created run's params, step-0 metrics and files in as few calls as the REST
    API allows (log_batch takes at most 100 params and 1000 metrics per call): over HTTP each
    call is a round trip, and a sweep driver prepares its trials one after another."""
    from mlflow.entities import Metric, Param

    from workbench.track.store import client

    c = client(uri)
    ps = [Param(k, str(v)[:6000]) for k, v in params.items()]
    ts = int(time.time() * 1000)
    ms = [Metric(k, float(v), ts, 0) for k, v in metrics.items()]
    for i in range(0, max(len(ps), 1), 100):
        with_retries(c.log_batch, run_id, params=ps[i:i + 100], metrics=ms if i == 0 else [])
    if run_id in _artifact_uris:  # the run's store is known: no get_run to find it
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        repo = get_artifact_repository(_artifact_uris.pop(run_id), tracking_uri=uri)
        for f in files:
            with_retries(repo.log_artifact, str(f), artifact_path)
    else:
        for f in files:
            with_retries(c.log_artifact, run_id, str(f), artifact_path)
