"""The sweep driver without Slurm: bad definitions fail before anything is submitted, a killed
driver resumes without losing or repeating a trial, 16 concurrent trial processes share one
Optuna journal and one MLflow sqlite store, and --multirun expands plain grids."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, cli, metric_series

SEEDS = ["+sweep=seeds", "sweep.parallelism=1", "sweep.poll_s=0.5", "train.threads=1", *FAST,
         "train.steps=6", "train.ckpt_every=3"]


@pytest.mark.parametrize("args, key", [
    (["sweep.bogus=1"], "sweep.bogus"),
    (["~sweep.space"], "sweep.space"),
    (["sweep.objectives=[accuracy]"], "sweep.objectives"),
    (["sweep.space.train.seed=[]"], "sweep.space.train.seed"),
    (["sweep.space.train.nonsense=[1,2]"], "sweep.space.train.nonsense"),
    (["sweep.space.launcher.nodes=[1,2]"], "sweep.space.launcher.nodes"),
    (["sweep.n_trials=0"], "sweep.n_trials"),
    (["sweep.mem_margin_gib=-1"], "sweep.mem_margin_gib"),
])
def test_bad_sweep_definition_fails_before_submitting(workdir, capsys, args, key):
    from workbench.run import main

    with pytest.raises(SystemExit) as exc:
        main(["+sweep=seeds", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {key}") and "\n" not in err, err
    assert not (workdir / "sweeps").exists() and not (workdir / "mlflow.db").exists()


def test_bad_sweep_is_one_line_exit_2_from_the_shell(workdir):
    proc = cli("workbench.run", ["+sweep=layout_search", "sweep.objectives=[accuracy]"], workdir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "accuracy" in lines[0] and "never logged" in lines[0], lines


def test_a_memory_margin_rejects_layouts_before_anything_launches(workdir):
    """`sweep.mem_margin_gib`: a layout predicted to leave less than the margin free is rejected
    with the numbers in its reason, told to Optuna as pruned, and never launched (here the
    margin exceeds the CPU cluster's 22.35 GiB, so every layout is)."""
    space = ["sweep.space.layout.dp_replicate=[1]", "sweep.space.layout.dp_shard=[1]",
             "sweep.space.layout.tp=[1]", "sweep.space.layout.pp=[1]",
             "sweep.space.train.micro_batch=[4,8]"]
    proc = cli("workbench.run", ["+sweep=layout_search", "sweep.mem_margin_gib=23", *space,
                                 "data.max_bytes=1000000"], workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = json.loads((workdir / "sweeps/layout_search/trials.json").read_text())
    assert len(trials) == 2 and all(t["status"] == "rejected" and not t["job_id"]
                                    and not t["run_dir"] for t in trials.values()), trials
    assert all(" GiB + 23 GiB margin > 22.35 GiB per device" in t["reason"]
               and t["pred"]["fits"] == 1.0 for t in trials.values()), trials
    assert not list((workdir / "sweeps/layout_search").glob("trials/*/job.json"))


def _trials(workdir: Path) -> dict:
    path = workdir / "sweeps" / "seeds" / "trials.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_killed_driver_resumes_without_losing_or_repeating_a_trial(workdir):
    """SIGKILL the driver while a trial runs; the resumed driver re-attaches to it, runs the
    rest, and every trial has exactly one MLflow run with each step logged once."""
    env = os.environ.copy()
    args = [*SEEDS, "sweep.space.train.seed=[1,2]", "sweep.n_trials=2"]
    driver = subprocess.Popen([sys.executable, "-m", "workbench.run", *args], cwd=workdir,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while time.time() < deadline:
        if any(t["status"] == "submitted" for t in _trials(workdir).values()):
            break
        assert driver.poll() is None, driver.stdout.read().decode()[-2000:]
        time.sleep(0.3)
    else:
        pytest.fail("no trial was submitted")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    again = cli("workbench.run", args, workdir, timeout=400)
    assert again.returncode == 2 and "sweep.resume" in again.stderr  # state exists: say so
    done = cli("workbench.run", [*args, "sweep.resume=true"], workdir, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _trials(workdir)
    assert sorted(t["status"] for t in trials.values()) == ["complete", "complete"], trials
    assert sorted(t["params"]["train.seed"] for t in trials.values()) == [1, 2]
    from workbench.sweep.state import open_study

    study = open_study(workdir / "sweeps/seeds/study.log", "seeds", ["minimize"])
    finished = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert len(finished) == 2 and all(t.state.is_finished() for t in study.get_trials())
    from mlflow.tracking import MlflowClient

    runs = MlflowClient().search_runs([MlflowClient().get_experiment_by_name(
        "workbench").experiment_id], filter_string="tags.`wb.sweep` = 'seeds'")
    children = [r for r in runs if r.data.tags.get("wb.sweep_role") != "parent"]
    assert len(children) == 2 and len(runs) == 3
    for run in children:
        steps = [s for s, _ in metric_series(run.info.run_id, "loss")]
        assert steps == list(range(6)), steps
        assert run.data.tags["mlflow.parentRunId"] in {r.info.run_id for r in runs}
    status = cli("workbench.sweep", ["status", "seeds"], workdir)
    assert status.returncode == 0 and "best: trial" in status.stdout


def _writer(i: int, journal: str, uri: str, q) -> None:
    """One trial process: ask, create its MLflow run, log, tell."""
    try:
        from workbench.config import TrackingConfig
        from workbench.sweep.state import open_study
        from workbench.track.tracker import MlflowTracker, create_run

        study = open_study(Path(journal), "conc", ["maximize"])
        trial = study.ask()
        x = trial.suggest_float("x", 0.0, 1.0)
        tracking = TrackingConfig(uri=uri, experiment="conc")
        run_id = create_run(tracking, f"trial-{i}", {"wb.trial": str(trial.number)})
        tracker = MlflowTracker(uri, run_id, flush_every_s=0.05)
        for step in range(5):
            tracker.log_metrics({"loss": x + step, "tokens_per_s": 100.0 * step}, step)
        tracker.close("FINISHED")
        study.tell(trial, x)
        q.put(("ok", i))
    except BaseException as e:
        q.put(("error", f"{i}: {type(e).__name__}: {e}"))


def _setup(journal: str, uri: str) -> None:
    from workbench.config import TrackingConfig
    from workbench.sweep.state import open_study
    from workbench.track.tracker import create_run

    open_study(Path(journal), "conc", ["maximize"])
    create_run(TrackingConfig(uri=uri, experiment="conc"), "setup", {})


@pytest.mark.slow
def test_16_concurrent_trials_share_one_optuna_journal_and_one_mlflow_store(tmp_path):
    import mlflow  # noqa: F401  (imported before fork: children start fast)
    import optuna  # noqa: F401

    journal, uri = str(tmp_path / "study.log"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = mp.get_context("fork")
    setup = ctx.Process(target=_setup, args=(journal, uri))  # schema created once, not raced
    setup.start()
    setup.join(120)
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(i, journal, uri, q)) for i in range(16)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    from mlflow.tracking import MlflowClient

    from workbench.sweep.state import open_study

    study = open_study(Path(journal), "conc", ["maximize"])
    assert sorted(t.number for t in study.get_trials()) == list(range(16))
    assert all(t.state.name == "COMPLETE" for t in study.get_trials())
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("conc").experiment_id],
                              filter_string="tags.`wb.trial` != ''", max_results=100)
    assert len(runs) == 16 and all(r.info.status == "FINISHED" for r in runs)
    for r in runs:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "loss")] == \
            list(range(5))


def test_multirun_expands_a_plain_grid_and_validates_it_first(workdir, capsys):
    from workbench.sweep.multirun import expand

    combos = expand(["train.seed=1,2", "layout=single", "train.lr=choice(0.1,0.2)"])
    assert len(combos) == 4 and combos[0] == ["train.seed=1", "layout=single", "train.lr=0.1"]
    from workbench.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--multirun", "train.seed=1,oops", "tracking=none"])
    assert exc.value.code == 2 and "train.seed" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_sweep_config_schema_and_space():
    from workbench.errors import ConfigError
    from workbench.sweep.space import budget, objectives, params, parse_sweep

    sweep = parse_sweep({"name": "x", "space": {"train": {"lr": {"low": 1e-4, "high": 1e-2,
                                                                  "log": True},
                                                          "seed": [1, 2]}},
                         "objectives": ["val_loss", "tokens_per_s:max"], "n_trials": 5})
    dists = params(sweep)
    assert set(dists) == {"train.lr", "train.seed"} and budget(sweep) == 5
    assert [o.direction for o in objectives(sweep)] == ["minimize", "maximize"]
    grid = parse_sweep({"name": "g", "space": {"layout": {"tp": [1, 2]}}, "n_trials": 9})
    assert budget(grid) == 2
    with pytest.raises(ConfigError, match="sweep.space.train.lr"):
        params(parse_sweep({"name": "x", "space": {"train": {"lr": ["fast"]}}}))


# `+sweep=lowrank_vs_fullrank` at test scale: two modes, one rank each, as local processes
LOWRANK = ["+sweep=lowrank_vs_fullrank", "sweep.overrides=['train.threads=1']",
           "sweep.space.lowrank.mode=[off,fixed]", "sweep.parallelism=2", "sweep.poll_s=0.5",
           "model.n_layers=2", "model.hidden=64", "model.ffn_hidden=256", "model.seq_len=64",
           "train.steps=12", "train.global_batch=4", "train.micro_batch=4",
           "train.warmup_steps=2", "train.eval_every=6", "train.eval_batches=1",
           "train.ckpt_every=100", "data.max_bytes=300000", "lowrank.keep_first_blocks=0",
           "lowrank.keep_last_blocks=0"]


@pytest.mark.slow
def test_a_detached_comparison_sweep_gets_its_comparison_from_collect(workdir):
    """`sweep.detach=true` on local processes: the driver starts both trials (in sessions of
    their own) and returns before either ends; `collect --wait` then drives the same loop as
    an attached driver, so once the last trial ends the parent run gets the low-rank
    comparison report and its numbers, and is closed."""
    from mlflow.tracking import MlflowClient

    detached = cli("workbench.run", [*LOWRANK, "sweep.detach=true"], workdir, timeout=300)
    assert detached.returncode == 0, detached.stderr[-3000:]
    assert "python -m workbench.sweep collect lowrank_vs_fullrank" in detached.stdout
    folder = workdir / "sweeps" / "lowrank_vs_fullrank"
    plan = json.loads((folder / "plan.json").read_text())
    trials = json.loads((folder / "trials.json").read_text())
    assert len(trials) == 2 and all(t["job_id"].startswith("pid:") for t in trials.values())
    assert plan["base_config"]["train"]["steps"] == 12 and "finished" not in plan
    c = MlflowClient()
    parent = plan["parent_run_id"]
    assert c.list_artifacts(parent, "report") == []  # nothing to compare yet

    done = cli("workbench.sweep", ["collect", "lowrank_vs_fullrank", "--wait"], workdir,
               timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = json.loads((folder / "trials.json").read_text())
    assert sorted(t["status"] for t in trials.values()) == ["complete", "complete"], trials
    assert "| off |" in done.stdout and "| fixed |" in done.stdout  # the report's table
    files = {f.path for f in c.list_artifacts(parent, "report")}
    assert {"report/report.md", "report/report.html", "report/loss_vs_tokens.png",
            "report/dp_scaling.png"} <= files, files
    run = c.get_run(parent)
    assert {"off/final_val_loss", "fixed/final_val_loss",
            "fixed/val_loss_gap_pct"} <= set(run.data.metrics), run.data.metrics
    assert run.info.status == "FINISHED"
    assert "finished" in json.loads((folder / "plan.json").read_text())


def test_resuming_with_more_trials_raises_the_budget(workdir):
    """`sweep.n_trials=N sweep.resume=true` continues a sweep with N trials in all: the budget
    recorded in plan.json grows, and a comparison written at its old end is written again."""
    from workbench.sweep.session import load, start
    from workbench.sweep.state import SweepState

    args = [*SEEDS, "sweep.space.train.seed=[1,2,3]"]
    first = load([*args, "sweep.n_trials=1"])
    start(first)
    first.state.unlock()
    first.state.plan["finished"] = "then"
    first.state.save_plan()
    more = load([*args, "sweep.n_trials=3", "sweep.resume=true"])
    start(more)
    more.state.unlock()
    plan = SweepState.load(workdir / "sweeps" / "seeds").plan
    assert plan["budget"] == 3 and plan["sweep"]["n_trials"] == 3 and "finished" not in plan
