"""The package installs as a package: a wheel built from the repository carries its configs, and
installed into a fresh environment (no source tree on the path) it composes the default config
and trains from an unrelated folder.

The fresh environment reuses this environment's third-party packages (torch, mlflow, ...)
through a path entry, so the test costs seconds rather than a reinstall of torch; a path entry
in a .pth file does not run that folder's own .pth files, so this checkout's editable install
stays invisible there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def test_wheel_installs_and_runs_outside_the_tree(tmp_path, cache_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
         tmp_path, env)
    (wheel,) = dist.glob("workbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "workbench/conf/config.yaml" in names
    assert "workbench/conf/model/gpt_tiny.yaml" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "workbench/testing/")) for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, env).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
          str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(py), "-c", "import workbench; print(workbench.__file__)"], elsewhere, env)
    assert where.stdout.strip().startswith(str(site)), where.stdout
    env |= {"WORKBENCH_CACHE": str(cache_dir), "MLFLOW_TRACKING_URI": "",
            "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI")
    composed = _run([str(py), "-c", "from workbench.compose import compose; c = compose([]); "
                     "print(c.model.name, c.layout.name, c.train.micro_batch)"], elsewhere, env)
    assert composed.stdout.split() == ["gpt_tiny", "single", "0"]
    out = _run([str(py), "-m", "workbench.run", "train.steps=2", "train.eval_every=1",
                "data.max_bytes=1000000"], elsewhere, env)
    assert "final loss" in out.stdout, out.stdout
    assert (elsewhere / "mlflow.db").exists() and (elsewhere / "runs").is_dir()
