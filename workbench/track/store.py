"""The MLflow store a run writes to, made safe to open and checked before anything starts.

- `client()` is the one MLflow client factory (commands, ranks, sweeps, calibration): one
  resolution of the store's URI and one way a missing or silent store is reported.
- A new sqlite store is created (schema migrated) by MLflow on its first touch. Several processes
  touching one new file at once each run the migration and all but one die with
  `table _alembic_tmp_latest_metrics already exists`; `client()` therefore holds an inter-process
  file lock beside the file around that first touch, so whoever comes first creates the store and
  the others find it made. The creation itself is a copy of a cached empty schema when one can be
  made (`sqlite_template`), which spares every new store MLflow's migrations.
- A tracking server (http/https) that does not answer is bad input at start: one line naming
  tracking.uri and exit 2, before anything is recorded or submitted (MLflow's own client would
  retry for minutes and end in a traceback).
- A sqlite file written from several nodes over a shared filesystem relies on file locking that
  network filesystems do not honour; such a run or sweep gets one warning naming the command
  that starts a server.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.errors import ConfigError, InputError
from workbench.places import tracking_uri
from workbench.track.sqlite_template import seed

SERVER_COMMAND = "python -m workbench.track.server start"
_warned: set[str] = set()  # warnings already printed by this process
_opened: set[str] = set()  # sqlite stores this process has opened under the lock
_reached: set[str] = set()  # stores this process found readable


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (None for anything else)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextmanager
def creation_lock(uri: str) -> Iterator[None]:
    """Exclusive flock on `<store>.lock` while a sqlite store is first opened; a no-op for
    other stores (a server creates its own database once)."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _made_stamp() -> str:
    import mlflow

    return f"created by mlflow {mlflow.__version__}\n"


def _made(uri: str) -> bool:
    """True when this store was created at this MLflow version (the stamp in its lock file):
    opening it then needs no lock, so concurrent runs do not queue behind each other."""
    path = sqlite_path(uri)
    if path is None or not path.exists() or path.stat().st_size == 0:
        return False
    try:
        return Path(f"{path}.lock").read_text() == _made_stamp()
    except OSError:
        return False


def client(uri: str = "", create: bool = True) -> Any:
    """The one MLflow client factory: every command, rank and sweep step gets its client here,
    so the store is found the same way everywhere (places.tracking_uri: `uri`, else
    $MLFLOW_TRACKING_URI, else ./mlflow.db) and a missing or silent store is one line of bad
    input. A sqlite store not yet made is created (or migrated) by one process at a time,
    under the lock, and stamped as made. create=False: a command that only reads (report,
    rerun, calibration), which must leave nothing behind, not even a lock: a sqlite store that
    does not exist, or a server that does not answer, is bad input instead."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(uri)
    # MLflow's REST client prints "View run ... at http://..." on every set_terminated (after
    # an extra get_run): one line per rank and trial is noise in job logs and a round trip.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not create:
        _check_readable(uri)
        return MlflowClient(tracking_uri=uri)
    if sqlite_path(uri) is None or uri in _opened or _made(uri):
        return MlflowClient(tracking_uri=uri)
    with tracking_errors(uri), creation_lock(uri):
        if not _made(uri):  # made by whoever held the lock before: nothing left to do here
            seed(sqlite_path(uri))  # a migrated empty schema, when one is cached for this MLflow
            c = MlflowClient(tracking_uri=uri)  # builds the store: creates and migrates it
            c.search_experiments(max_results=1)
            Path(f"{sqlite_path(uri)}.lock").write_text(_made_stamp())
    _opened.add(uri)
    return MlflowClient(tracking_uri=uri)


def _check_readable(uri: str) -> None:
    """A store to read must exist (sqlite) or answer (a server, asked once per process: a
    writer's retries ride out a restart, a reader has nothing to wait for)."""
    path = sqlite_path(uri)
    if path is not None and not path.exists():
        raise InputError(f"tracking uri {uri!r}: no MLflow store there (run from the folder "
                         "that holds mlflow.db, or set MLFLOW_TRACKING_URI / tracking.uri)")
    if uri not in _reached:
        check_reachable(uri)
        _reached.add(uri)


@contextmanager
def tracking_errors(uri: str) -> Iterator[None]:
    """Turn a failure to reach or write the tracking store into one line of bad input."""
    import sqlite3

    from mlflow.exceptions import MlflowException

    kinds: tuple[type[BaseException], ...] = (MlflowException, sqlite3.Error, OSError)
    try:
        from sqlalchemy.exc import SQLAlchemyError

        kinds += (SQLAlchemyError,)
    except ImportError:  # pragma: no cover (mlflow depends on sqlalchemy)
        pass
    try:
        yield
    except kinds as e:
        first = " ".join(str(e).split("\n")[0].split())[:300]
        raise InputError(f"tracking store {redact(uri)}: {type(e).__name__}: {first}") from None


def redact(url: str) -> str:
    """The URL without its password (what is printed, logged or tagged)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """A tracking server must answer at start (any HTTP answer counts: with --auth it may be
    401); else ConfigError naming tracking.uri and the command that starts one."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError("tracking.uri", redact(uri),
                          f"no tracking server answers there ({reason}); start one with "
                          f"`{SERVER_COMMAND}` or point tracking.uri / WORKBENCH_TRACKING_URI "
                          "at yours") from None


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr)


def check_tracking(cfg: RunConfig, array_parallelism: int = 1) -> None:
    """Before anything is recorded or submitted: the server answers, and a sqlite store is not
    about to be written from several nodes (`array_parallelism`: Slurm array tasks at once)."""
    if cfg.tracking.backend == "none":
        return
    uri = cfg.tracking.resolved_uri()
    check_reachable(uri)
    path = sqlite_path(uri)
    if path is None:
        return
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError("tracking.uri", uri, f"cannot create a sqlite store there ({folder} "
                          "is not a writable folder)")
    if cfg.launcher.name != "slurm":
        return
    nodes, parallel = cfg.launcher.nodes, array_parallelism
    if nodes > 1 or parallel > 1:
        why = f"launcher.nodes={nodes}" if nodes > 1 else f"{parallel} array tasks at once"
        warn_once("shared-sqlite", f"{why} would write one sqlite store ({uri}) from several "
                  "nodes, whose file locks are unreliable on shared filesystems; start a "
                  f"tracking server with `{SERVER_COMMAND}` and use tracking=server")
