"""A new sqlite MLflow store starts as a copy of an empty, already-migrated one.

Why: MLflow builds a new sqlite store by running its whole chain of schema migrations, which costs
about 3 s of CPU on every fresh `mlflow.db`: every new experiment folder, every test, every
benchmark that writes its own store pays it before the first training step. The migrated schema
depends only on the MLflow version, so it is built once per version into the cache
(`<cache>/mlflow/sqlite-<version>.db`, with no experiment rows: MLflow adds the Default experiment,
with this store's own artifact location, when it first opens the copy) and copied from then on.

Anything unusual (a read-only cache, a template from a broken earlier attempt) falls back to
MLflow's own creation: this only saves time, it never decides what a store contains.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from workbench.places import cache_root


def template_path() -> Path:
    import mlflow

    return cache_root() / "mlflow" / f"sqlite-{mlflow.__version__}.db"


def _valid(path: Path) -> bool:
    """A template is a migrated schema with no experiments; anything else is rebuilt."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            version = con.execute("SELECT version_num FROM alembic_version").fetchone()
            experiments = con.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return bool(version) and experiments == 0


def _build(path: Path) -> None:
    """MLflow migrates a scratch store; its experiment rows are dropped so that each copy gets
    its own Default experiment (artifact location included) from MLflow."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        db = Path(scratch) / "store.db"
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)
        con = sqlite3.connect(db)
        try:
            con.execute("DELETE FROM experiment_tags")
            con.execute("DELETE FROM experiments")
            con.commit()
            con.execute("VACUUM")
        finally:
            con.close()
        os.replace(db, path)


def ensure_template() -> Path | None:
    """The template for this MLflow version, built under a lock by the first process that needs
    it; None when it cannot be built here."""
    path = template_path()
    try:
        if _valid(path):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _valid(path):
                _build(path)
        finally:
            os.close(fd)
    except (OSError, sqlite3.Error):
        return None
    return path if _valid(path) else None


def seed(store: Path) -> bool:
    """Copy the template to a store that does not exist yet (or is an empty file); the caller
    holds the store's creation lock. False: nothing copied, MLflow creates the store itself."""
    if store.exists() and store.stat().st_size > 0:
        return False
    template = ensure_template()
    if template is None:
        return False
    part = store.with_name(f".{store.name}.{os.getpid()}.part")
    try:
        shutil.copyfile(template, part)
        os.replace(part, store)  # a reader never sees half a file
    except OSError:
        part.unlink(missing_ok=True)
        return False
    return True
