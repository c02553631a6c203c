"""The comparison report of four runs (off, adaptive, fixed, powersgd) under one parent: built by
`python -m workbench.report`, attached to the parent, and the four runs with their
`comm/bytes_per_step` and `val_loss` visible in the MLflow UI's comparison view, opened in
headless Chromium (Debian's chromium driven by Playwright; CI fails, not skips, without it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import cli, in_ci

MODES = ("off", "adaptive", "fixed", "powersgd")
CHROMIUM = "/usr/bin/chromium"


def make_runs(uri: str) -> tuple[str, str, dict[str, str]]:
    """A parent and four child runs with the metrics training logs (synthetic, fast)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("workbench")
    parent = c.create_run(exp, run_name="sweep-lowrank_vs_fullrank").info.run_id
    ids = {}
    full_bytes = 4.0e6
    for i, mode in enumerate(MODES):
        run = c.create_run(exp, run_name=f"gpt_tiny-ddp-{mode}",
                           tags={"mlflow.parentRunId": parent})
        rid = ids[mode] = run.info.run_id
        params = {"lowrank.mode": mode, "train.global_batch": "8", "model.seq_len": "64"}
        ms: list[Metric] = []
        t0 = 1_700_000_000_000
        for step in range(40):
            after = mode in ("adaptive", "fixed") and step >= 6 or mode == "powersgd" and step >= 5
            by = full_bytes * ({"adaptive": 0.5, "fixed": 0.4, "powersgd": 0.05}.get(mode, 1.0)
                              if after else 1.0)
            ms += [Metric("loss", 5.0 - 0.05 * step - 0.01 * i, t0 + 100 * step, step),
                   Metric("tokens_per_s", 4000.0 + 100 * i, t0 + 100 * step, step),
                   Metric("comm/bytes_per_step", by, t0 + 100 * step, step),
                   Metric("params/trainable", by / 4, t0 + 100 * step, step)]
        for step in (0, 10, 20, 30, 40):
            ms.append(Metric("val_loss", 5.0 - 0.05 * step + 0.01 * i, t0 + 100 * step, step))
        if mode in ("adaptive", "fixed"):
            ms += [Metric("lowrank/switch_step", 6, t0 + 600, 5),
                   Metric("rank/layers.1.attention.wo", 16 + i, t0 + 600, 5)]
        c.log_batch(rid, metrics=ms, params=[Param(k, v) for k, v in params.items()])
        c.set_terminated(rid)
    return exp, parent, ids


def test_report_cli_builds_tables_and_plots_and_attaches_them(workdir):
    uri = os.environ["MLFLOW_TRACKING_URI"]
    _, parent, ids = make_runs(uri)
    out = workdir / "rep"
    proc = cli("workbench.report", [parent, "--parent", parent, "--out", str(out)], workdir)
    assert proc.returncode == 0, proc.stderr
    rows = {r["run"]: r for r in json.loads((out / "summary.json").read_text())}
    assert set(rows) == set(MODES)
    assert rows["adaptive"]["bytes_reduction_pct"] == pytest.approx(50.0)
    assert rows["powersgd"]["bytes_reduction_pct"] == pytest.approx(95.0)
    assert rows["adaptive"]["switch_step"] == 6 and rows["off"]["val_loss_gap_pct"] == 0
    assert rows["fixed"]["val_loss_gap_pct"] == pytest.approx(100 * 0.02 / 3.0)
    for name in ("report.md", "report.html", "loss_vs_tokens.png", "loss_vs_wallclock.png",
                 "bytes_and_throughput.png"):
        assert (out / name).stat().st_size > 100, name
    assert "layers.1.attention.wo" in (out / "report.md").read_text()
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    assert {"report/report.html", "report/loss_vs_tokens.png"} <= \
        {f.path for f in c.list_artifacts(parent, "report")}
    assert "adaptive/bytes_reduction_pct" in c.get_run(parent).data.metrics
    # the same runs named one by one; a bad name is one line, exit 2
    assert cli("workbench.report", [*ids.values(), "--out", str(workdir / "r2")],
               workdir).returncode == 0
    bad = cli("workbench.report", ["nope"], workdir)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        assert proc.poll() is None, "mlflow server exited"
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("mlflow server did not answer /health")


@pytest.mark.browser
def test_comparison_of_four_runs_in_the_mlflow_ui(workdir):
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        if in_ci():
            pytest.fail("Debian chromium is missing (.ci/run installs it: apt-get install "
                        "chromium)")
        pytest.skip("no /usr/bin/chromium")
    try:
        import playwright  # noqa: F401
    except ImportError:
        if in_ci():
            pytest.fail("playwright is missing (the dev extra installs it)")
        pytest.skip("playwright is not installed")
    from playwright.sync_api import expect, sync_playwright

    uri = os.environ["MLFLOW_TRACKING_URI"]
    exp, _, ids = make_runs(uri)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", uri,
         "--default-artifact-root", str(workdir / "mlartifacts")],
        cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        _wait_health(base, server)
        flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync",  # Playwright gives each launch a fresh profile
                 ("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost , "
                  "EXCLUDE 127.0.0.1")]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                run_ids = list(ids.values())
                page.goto(f"{base}/#/compare-runs?runs={urllib.parse.quote(json.dumps(run_ids))}"
                          f"&experiments={urllib.parse.quote(json.dumps([exp]))}")
                expect(page.get_by_text("Comparing 4 Runs")).to_be_visible(timeout=60000)
                for mode in MODES:
                    expect(page.get_by_text(f"gpt_tiny-ddp-{mode}", exact=True).first) \
                        .to_be_visible(timeout=30000)
                html = page.content()
                for key in ("comm/bytes_per_step", "val_loss"):
                    expect(page.get_by_text(key, exact=True).first).to_be_visible(
                        timeout=30000)
                    assert key in html, key
                page.screenshot(path=str(workdir / "compare.png"), full_page=True)
            finally:
                browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
