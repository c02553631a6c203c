"""Against the real tracking server of `python -m workbench.track.server` (PostgreSQL + `mlflow
server`): concurrent Optuna workers and concurrent MLflow runs on the shared server that .ci/run
starts (its env file gives WORKBENCH_TRACKING_URI / WORKBENCH_OPTUNA_STORAGE / PGPASSFILE), and,
on a private instance with --auth that these tests start on free ports: a request without
credentials is refused, and a real run survives the server being killed and restarted mid-run.
Under CI a missing server fails; locally these tests skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import FAST, REPO, env_file_vars, healthy, need_service, tracking_server_env

pytestmark = [pytest.mark.xdist_group("tracking_server")]
USER, PASSWORD = "wb-admin", "s3cret-not-logged-7f3a"


def _need(why: str) -> None:
    need_service("the tracking server", why)


_healthy = healthy


@pytest.fixture(scope="module")
def shared_server() -> dict:
    """The server .ci/run started (its variables in the environment, or its env file)."""
    return tracking_server_env()


def _load(kind: str, target: str, name: str, n: int, per: int, env: dict) -> list:
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tracking_load.py"), kind,
                           target, name, str(n), str(per)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])["ids"]


@pytest.mark.slow
def test_16_concurrent_optuna_workers_lose_no_trial(shared_server):
    import optuna

    study = f"load-{os.getpid()}-{time.time_ns()}"
    storage = shared_server["WORKBENCH_OPTUNA_STORAGE"]
    _load("optuna", storage, study, 16, 4, shared_server)
    os.environ.setdefault("PGPASSFILE", shared_server["PGPASSFILE"])
    trials = optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(64))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    per_worker = [t.user_attrs["worker"] for t in trials]
    assert sorted(set(per_worker)) == list(range(16))
    assert all(per_worker.count(w) == 4 for w in range(16))


@pytest.mark.slow
def test_32_concurrent_runs_lose_no_metric(shared_server):
    from mlflow.tracking import MlflowClient

    uri, steps = shared_server["WORKBENCH_TRACKING_URI"], 50
    experiment = f"load-{os.getpid()}-{time.time_ns()}"
    run_ids = _load("mlflow", uri, experiment, 32, steps, shared_server)
    assert len(set(run_ids)) == 32
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert sorted(r.info.run_id for r in client.search_runs([exp.experiment_id])) == run_ids
    for run_id in run_ids:
        assert client.get_run(run_id).info.status == "FINISHED"
        for key in ("loss", "lr"):
            steps_seen = sorted(m.step for m in client.get_metric_history(run_id, key))
            assert steps_seen == list(range(steps)), (run_id, key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def auth_server():
    """A private instance with --auth on free ports, stopped at the end of the module."""
    if os.geteuid() != 0 and not Path("/usr/lib/postgresql").is_dir():
        _need("PostgreSQL is not installed and this is not root")
    # Not under pytest's 0700 basetemp: as root, PostgreSQL runs as `postgres`, which must reach it
    state = Path(tempfile.mkdtemp(prefix="workbench-tracking-auth-", dir="/tmp"))
    os.chmod(state, 0o755)
    args = ["--dir", str(state), "--port", str(_free_port()), "--pg-port", str(_free_port()),
            "--workers", "1", "--auth"]  # one worker: it starts (twice) on a busy CI box
    env = {**os.environ, "MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    start = [sys.executable, "-m", "workbench.track.server", "start", *args]

    def stop() -> None:  # whatever part of it did start
        subprocess.run([sys.executable, "-m", "workbench.track.server", "stop", "--dir",
                        str(state)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)

    proc = subprocess.run(start, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode:
        stop()
        _need(f"the --auth instance did not start: {proc.stderr.strip()[-500:]}")
    try:
        yield {"state": state, "start": start, "env": env, **env_file_vars(state / "env.sh")}
    finally:
        stop()


def test_auth_refuses_a_request_without_credentials(auth_server):
    url = f"{auth_server['WORKBENCH_TRACKING_URI']}/api/2.0/mlflow/experiments/search" \
          "?max_results=1"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=30)
    assert e.value.code == 401
    wrong = urllib.request.Request(url, headers={"Authorization": "Basic d2ItYWRtaW46bm8="})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(wrong, timeout=30)  # wb-admin:no
    assert e.value.code == 401
    import base64

    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    ok = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(ok, timeout=30) as r:
        assert r.status == 200
    assert PASSWORD not in (auth_server["state"] / "log" / "mlflow.log").read_text()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.slow
def test_server_killed_and_restarted_mid_run_loses_no_step(auth_server, workdir, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = auth_server["WORKBENCH_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    steps = 40
    keep = [a for a in FAST if not a.startswith(("train.steps", "train.ckpt", "train.eval"))]
    args = [*keep, f"train.steps={steps}", "train.ckpt_every=10", f"train.eval_every={steps}",
            "model.n_layers=2", "model.hidden=64", "model.ffn_hidden=256", "model.seq_len=64",
            f"tracking.uri={uri}"]  # a tiny model: the run outlives the restart, cheaply
    run = subprocess.Popen([sys.executable, "-m", "workbench.run", *args], cwd=workdir,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=os.environ.copy())
    client = MlflowClient(tracking_uri=uri)

    def first_steps():
        exp = client.get_experiment_by_name("workbench")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs and client.get_metric_history(runs[0].info.run_id, "loss") and runs[0]

    t0, times = time.time(), {}
    try:
        logged = _wait(first_steps, 240, "the run's first logged step")
        times["first_step"] = time.time() - t0
        pid = int((auth_server["state"] / "run" / "mlflow.pid").read_text())
        os.killpg(pid, signal.SIGKILL)  # the whole server, as a crash would
        _wait(lambda: not _healthy(uri), 30, "the server to go down")
        times["killed"] = time.time() - t0
        time.sleep(2)
        restart = subprocess.run(auth_server["start"], capture_output=True, text=True,
                                 timeout=300, env=auth_server["env"])
        assert restart.returncode == 0, restart.stderr[-2000:]
        times["restarted"] = time.time() - t0
        out, _ = run.communicate(timeout=600)
        times["run_done"] = time.time() - t0
    finally:
        if run.poll() is None:
            run.kill()
    print(f"kill/restart timeline (s): {times}")
    assert run.returncode == 0, (times, out[-4000:])
    run_id = logged.info.run_id
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == \
        list(range(steps))
    recorded = list(finished.data.params.values()) + list(finished.data.tags.values())
    assert not any(PASSWORD in v for v in recorded)
