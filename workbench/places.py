"""Where things go by default. The few defaults that depend on the environment or on the working
folder are resolved here and nowhere else, so that what a run writes, and where, is predictable
from one page (and a test or a cluster setup can redirect all of it with the same variables)."""

from __future__ import annotations

import os
from pathlib import Path

RUNS_DIR = "runs"  # a run's folder: RUNS_DIR/<stamp>-<model>-<id>, relative to the working folder
SWEEPS_DIR = "sweeps"  # durable sweep state: SWEEPS_DIR/<name>/


def tracking_uri(explicit: str = "") -> str:
    """The MLflow store: explicit, then $MLFLOW_TRACKING_URI, then `mlflow.db` (sqlite) in the
    working folder, which is where `mlflow ui` run from the same folder looks."""
    if explicit:
        return explicit
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def cache_root(explicit: str = "") -> Path:
    """Tokenized corpora are cached across runs: explicit, then $WORKBENCH_CACHE, then
    ~/.cache/workbench (per user, so several checkouts share one tokenization)."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("WORKBENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "workbench"


def user_conf_dir() -> Path:
    """The user's own config groups (profiled clusters, own models): $WORKBENCH_CONF, else
    `conf/` in the working folder, searched before the package's groups."""
    return Path(os.environ.get("WORKBENCH_CONF") or "conf")


def runs_root() -> Path:
    return Path(RUNS_DIR)


def show_traceback() -> bool:
    """WORKBENCH_TRACEBACK=1: bad input still exits 2, with the traceback for a bug report."""
    return bool(os.environ.get("WORKBENCH_TRACEBACK"))
