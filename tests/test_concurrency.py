"""Past one run: a new sqlite store is created once whoever gets there first, a tracking server
that does not answer stops a run or sweep before anything exists, a sqlite store about to be
written from several nodes is warned about once, the sweep's Optuna study can live in an RDB,
and concurrent local trials get their share of the cores (recorded as train.threads)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from conftest import FAST

N_RUNS = 4  # twice the CI machine's 2 cores, so that the processes truly overlap


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_exit_2(argv, capsys) -> str:
    from workbench.run import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_unreachable_server_stops_a_run_and_a_sweep_before_anything_exists(workdir, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("WORKBENCH_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    for argv in (["tracking=server", *FAST], ["+sweep=seeds", "tracking=server", *FAST]):
        err = _one_line_exit_2(argv, capsys)
        assert "tracking.uri" in err and "python -m workbench.track.server start" in err, err
    assert not any(p.name in ("mlflow.db", "runs", "sweeps") for p in workdir.iterdir())


def test_a_store_that_cannot_be_created_is_one_line(workdir, capsys):
    (workdir / "a_file").write_text("")
    err = _one_line_exit_2([f"tracking.uri=sqlite:///{workdir}/a_file/mlflow.db", *FAST], capsys)
    assert err.startswith("error: tracking.uri=") and "not a writable folder" in err, err
    with pytest.raises(Exception, match="tracking store sqlite:///"):  # past the check: one line
        from workbench.track.store import client

        client(f"sqlite:///{workdir}/a_file/mlflow.db")


def test_one_client_factory_finds_and_checks_the_store_the_same_way(workdir, monkeypatch):
    """Every reader and writer gets its MLflow client from track.store.client: no URI means
    $MLFLOW_TRACKING_URI (else ./mlflow.db); a reader is refused a sqlite store that does not
    exist (nothing created, not even a lock) and a server that does not answer, in one line."""
    from workbench.errors import ConfigError, InputError
    from workbench.track.store import client

    with pytest.raises(InputError, match="no MLflow store there"):
        client(create=False)
    assert list(workdir.iterdir()) == []
    assert client().tracking_uri == os.environ["MLFLOW_TRACKING_URI"]  # a writer makes it
    assert client(create=False).tracking_uri == os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert client(create=False).tracking_uri == f"sqlite:///{workdir / 'mlflow.db'}"
    with pytest.raises(ConfigError, match="no tracking server answers there") as e:
        client("http://127.0.0.1:9", create=False)  # the discard port: nothing listens
    assert e.value.key == "tracking.uri" and "\n" not in str(e.value)


def test_bad_sweep_storage_is_one_line(workdir, capsys):
    err = _one_line_exit_2(["+sweep=seeds", "sweep.storage=/tmp/study.db"], capsys)
    assert err.startswith("error: sweep.storage=") and "postgresql://" in err, err
    assert not (workdir / "sweeps").exists()


def test_sqlite_from_several_nodes_warns_once(workdir, capsys):
    from workbench.compose import compose
    from workbench.track import store

    cfg = compose(["launcher=slurm", "launcher.nodes=2"])
    store._warned.clear()
    for _ in range(2):
        store.check_tracking(cfg)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "python -m workbench.track.server start" in err, err
    store._warned.clear()
    cfg.launcher.nodes = 1
    store.check_tracking(cfg)  # one task on one node: fine
    assert capsys.readouterr().err == ""
    store.check_tracking(cfg, array_parallelism=4)  # an array: tasks on several nodes
    cfg.launcher.name = "local"
    store.check_tracking(cfg, array_parallelism=4)  # local processes: one node
    assert capsys.readouterr().err.count("warning:") == 1


@pytest.mark.slow
def test_runs_started_at_once_into_a_new_sqlite_store_all_finish(workdir):
    """Each process would otherwise run MLflow's schema migration on the fresh file at the same
    moment, and all but one die (`table _alembic_tmp_latest_metrics already exists`). The cached
    empty schema the store is copied from is removed first, so they also race to build that."""
    from workbench.track.sqlite_template import template_path

    assert not (workdir / "mlflow.db").exists()
    template_path().unlink(missing_ok=True)
    args = ["train.steps=1", "train.eval_every=1", "train.eval_batches=1", "train.warmup_steps=0",
            "train.global_batch=2", "train.micro_batch=2", "data.max_bytes=1000000",
            "train.threads=1"]
    procs = [subprocess.Popen([sys.executable, "-m", "workbench.run", *args,
                               f"train.run_dir=runs/r{i}"], cwd=workdir, env=os.environ.copy(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(N_RUNS)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    failed = [(i, out[-400:]) for i, (p, out) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, failed
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert len(runs) == N_RUNS and {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.params["train.threads"] for r in runs} == {"1"}


@pytest.mark.slow
def test_local_sweep_shares_cores_and_keeps_its_study_in_an_rdb(workdir):
    """Two trials at once, train.threads not set: each gets cores // 2 (recorded in its params);
    the Optuna study lives in the sqlite RDB named by sweep.storage, not in a journal file."""
    import optuna
    from conftest import cli
    from mlflow.tracking import MlflowClient

    from workbench.launch.world import cores

    url = f"sqlite:///{workdir / 'optuna.db'}"
    args = ["+sweep=seeds", "sweep.space.train.seed=[1,2]", "sweep.n_trials=2",
            "sweep.parallelism=2", "sweep.poll_s=0.5", f"sweep.storage={url}", *FAST,
            "train.steps=2", "train.eval_every=2"]
    proc = cli("workbench.run", args, workdir, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    study = optuna.load_study(study_name="seeds", storage=url)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "COMPLETE"]
    assert not (workdir / "sweeps" / "seeds" / "study.log").exists()
    client = MlflowClient()
    exp = client.get_experiment_by_name("workbench").experiment_id
    trials = client.search_runs([exp], "tags.`wb.trial` != ''")
    assert len(trials) == 2
    assert {r.data.params["train.threads"] for r in trials} == {str(max(1, cores() // 2))}
