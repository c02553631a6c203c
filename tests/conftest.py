"""Shared fixtures: every test runs in its own folder with its own MLflow sqlite store; the
embedded corpus is built once per session into a shared cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST = ["train.steps=12", "train.eval_every=4", "train.ckpt_every=6", "train.warmup_steps=3",
        "train.global_batch=4", "train.micro_batch=4", "data.max_bytes=1000000"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def published_layouts_csv() -> Path:
    """The published rows the planner is scored on (benchmarks/calibration/): part of the
    repository, so a missing file is a failure, never a skip."""
    path = REPO / "benchmarks" / "calibration" / "published_layouts.csv"
    assert path.is_file(), f"{path} is missing"
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wb-cache")


@pytest.fixture
def workdir(tmp_path, cache_dir, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache_dir))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return tmp_path


TRACKING_ENV_FILE = Path("/tmp/workbench-tracking/env.sh")


def env_file_vars(path: Path) -> dict:
    """The `export KEY=VALUE` lines of a service's env file."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            out[key] = value
    return out


def tracking_server_env() -> dict:
    """WORKBENCH_TRACKING_URI / WORKBENCH_OPTUNA_STORAGE / PGPASSFILE of the tracking server
    .ci/run starts (from the environment, else its env file) when it answers /health; under CI
    a missing server fails the test, locally it skips."""
    keys = ("WORKBENCH_TRACKING_URI", "WORKBENCH_OPTUNA_STORAGE", "PGPASSFILE")
    env = {k: os.environ[k] for k in keys if k in os.environ}
    if "WORKBENCH_TRACKING_URI" not in env and TRACKING_ENV_FILE.exists():
        env = env_file_vars(TRACKING_ENV_FILE)
    why = "no tracking server (run tracking/start-local-server.sh, source its env.sh)"
    if "WORKBENCH_TRACKING_URI" in env:
        if healthy(env["WORKBENCH_TRACKING_URI"]):
            return env
        why = f"tracking server {env['WORKBENCH_TRACKING_URI']} does not answer /health"
    need_service("the tracking server", why)


def healthy(uri: str) -> bool:
    """Whether an MLflow server answers /health with 200."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def need_service(what: str, why: str) -> None:
    """A missing service fails the test under CI and skips it locally."""
    if in_ci():
        pytest.fail(f"CI needs {what}: {why}")
    pytest.skip(why)


def cli(module: str, args: List[str], cwd: Path, timeout: float = 600,
        **popen) -> subprocess.CompletedProcess:
    """Run `python -m module args` as a user would, in cwd, with the test's environment."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy(), **popen)


def metric_series(run_id: str, key: str) -> List[tuple]:
    """(step, value) pairs of one metric, in step order, straight from the store."""
    from mlflow.tracking import MlflowClient

    hist = MlflowClient().get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)


def benchmark_module(name: str):
    """benchmarks/NAME.py imported as module NAME (the scripts are not a package), so a test
    calls its functions and main() in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def only_run(experiment: str = "workbench"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def pytest_configure(config):
    """Under pytest-xdist every worker gets its share of the cores: each process it starts (and
    the worker itself) runs torch on cores // workers threads. Left at torch's default, every
    process spins one thread per core and two workers on 2 cores run several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)
    config.pluginmanager.register(_GroupingCheck(), "workbench-grouping-check")


# Tests that run for minutes go first, so that pytest-xdist's workers finish together instead of
# one idling while the other runs the last long test (longest-first scheduling).
LONG = ("test_slurm.py", "test_tracking_server.py", "test_default_run.py::test_default_run",
        "test_repro_resume.py::test_sigkill", "test_parallel_4ranks.py", "test_parallel.py",
        "test_cpu_gpu_paths.py", "test_lowrank_ddp.py", "test_lowrank_heldout.py")


# Modules whose tests share one expensive module-scoped fixture (a matrix of multi-rank runs).
SHARED_MODULE_FIXTURE = ("test_parallel.py", "test_parallel_4ranks.py", "test_lowrank_parallel.py",
                         "test_lowrank_heldout.py")


def _long_readme_block(item) -> bool:
    """A README block that runs a sweep, a benchmark or many commands (ids are line numbers,
    which move with every edit of the README, so the block's content decides)."""
    block = getattr(item, "callspec", None) and item.callspec.params.get("block")
    if block is None or not hasattr(block, "commands"):
        return False
    return len(block.commands) >= 5 or any("+sweep=" in c or "benchmarks/" in c
                                           for c in block.commands)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Every test that uses the one-node Slurm cluster runs on one pytest-xdist worker (its two
    CPUs are one resource), as do the tracking-server tests and each module of
    SHARED_MODULE_FIXTURE; the Slurm group first, then the other long tests."""
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.path.name in SHARED_MODULE_FIXTURE:  # its fixture computed once, not per worker
            item.add_marker(pytest.mark.xdist_group(item.path.stem))

    def rank(item) -> tuple:
        slurm = item.get_closest_marker("slurm") is not None
        long = 0 if _long_readme_block(item) else \
            next((i + 1 for i, key in enumerate(LONG) if key in item.nodeid), len(LONG) + 1)
        slow = item.get_closest_marker("slow") is not None
        return (not slurm, long, not slow)

    items.sort(key=rank)  # stable: collection order within a rank



class _GroupingCheck:
    """pytest-xdist groups by a suffix it writes into each node id; a pytest that reads node ids
    from elsewhere (9.2) silently drops it and every group is spread over the workers again (two
    Slurm tests at once on a 2-CPU cluster, each multi-rank fixture computed twice)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        lost = [i.nodeid for i in items
                if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist dropped the xdist_group of {lost[0]} (and "
                                    f"{len(lost) - 1} more): use a pytest it supports")
