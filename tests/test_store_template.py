"""A new sqlite store is a copy of a cached, migrated, empty schema: the copy must be the store
MLflow itself would have made (same schema version and tables, its own Default experiment), a
broken or stale template is rebuilt, and a cache that cannot be written changes nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from workbench.track import sqlite_template
from workbench.track.store import client


def _schema(db: Path) -> tuple[str, list[tuple[str, list[str]]]]:
    """Schema version and each table's and index's definition as a sorted list of its clauses:
    Alembic's batch migrations write a rebuilt table's CHECK constraints in set order, which
    differs between processes (string hashing), so two stores MLflow made can differ in it."""
    con = sqlite3.connect(db)
    try:
        version = con.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        rows = con.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table','index')"
                           " AND name NOT LIKE 'sqlite_%' ORDER BY name").fetchall()
    finally:
        con.close()
    return version, [(name, sorted(c.strip().rstrip(",") for c in sql.splitlines()))
                     for name, sql in rows]


def test_a_new_store_is_the_store_mlflow_makes(workdir):
    from mlflow.tracking import MlflowClient

    own = workdir / "own" / "mlflow.db"
    own.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{own}").search_experiments(max_results=1)

    copied = workdir / "copied" / "mlflow.db"
    c = client(f"sqlite:///{copied}")
    assert sqlite_template.template_path().is_file()  # built on first need, in the cache
    assert _schema(copied) == _schema(own)
    default = c.get_experiment("0")
    assert default.name == "Default"
    # this store's folder, not the cache's
    assert default.artifact_location == str(workdir / "mlruns" / "0")
    exp = c.create_experiment("workbench")
    run = c.create_run(exp)
    c.log_metric(run.info.run_id, "loss", 1.5, step=0)
    c.set_terminated(run.info.run_id)
    again = client(f"sqlite:///{copied}")  # reopening leaves the data alone
    assert [m.value for m in again.get_metric_history(run.info.run_id, "loss")] == [1.5]


def test_a_broken_or_stale_template_is_rebuilt(workdir):
    path = sqlite_template.template_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a database")
    client(f"sqlite:///{workdir / 'a.db'}").create_experiment("x")
    assert sqlite_template._valid(path)

    con = sqlite3.connect(path)  # a template holding an experiment would leak it into copies
    con.execute("INSERT INTO experiments (experiment_id, name, lifecycle_stage) "
                "VALUES (7, 'stale', 'active')")
    con.commit()
    con.close()
    c = client(f"sqlite:///{workdir / 'b.db'}")
    assert [e.name for e in c.search_experiments()] == ["Default"]


def test_an_unwritable_cache_falls_back_to_mlflow(workdir, monkeypatch):
    (workdir / "a_file").write_text("")
    monkeypatch.setenv("WORKBENCH_CACHE", str(workdir / "a_file" / "cache"))
    assert sqlite_template.ensure_template() is None
    store = workdir / "store.db"
    assert not sqlite_template.seed(store) and not store.exists()
    c = client(f"sqlite:///{store}")
    assert [e.name for e in c.search_experiments()] == ["Default"]
