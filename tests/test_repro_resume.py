"""Reproducibility is the product: same config and seed give bitwise-equal losses; a rerun from
the manifest reproduces them; a SIGKILLed run resumes from its checkpoint into the same MLflow run
with the same loss series, no step duplicated or missing; a damaged checkpoint is never loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, cli, metric_series

from workbench.run import main

LONGER = [o for o in FAST if not o.startswith(("train.steps", "train.ckpt_every",
                                               "train.global_batch", "train.micro_batch"))]


def _runs():
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.get_experiment_by_name("workbench")
    return sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def test_same_config_and_seed_give_bitwise_equal_losses_and_rerun_reproduces(workdir):
    assert main(FAST) == 0
    assert main(FAST) == 0
    a, b = (r.info.run_id for r in _runs())
    for key in ("loss", "val_loss"):
        sa, sb = metric_series(a, key), metric_series(b, key)
        assert sa == sb and len(sa) > 2, key
    assert [s for s, _ in metric_series(a, "loss")] == list(range(12))

    from workbench.rerun import main as rerun

    assert rerun([a]) == 0
    c = _runs()[-1]
    assert c.data.tags["wb.rerun_of"] == a
    for key in ("loss", "val_loss"):
        assert metric_series(c.info.run_id, key) == metric_series(a, key)


def test_other_seed_gives_other_losses(workdir):
    assert main(FAST) == 0
    assert main(FAST + ["train.seed=7"]) == 0
    a, b = (r.info.run_id for r in _runs())
    assert metric_series(a, "loss") != metric_series(b, "loss")


def _complete(run_dir: Path, step: int) -> list:
    """The completion record of a run's checkpoint of `step`, if written (in any layout)."""
    return list(run_dir.glob(f"checkpoints/*/step_{step:08d}/complete.json"))


def _wait_for(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    t0 = time.time()
    while not _complete(run_dir, step):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout_s
        time.sleep(0.05)


def test_sigkill_then_restart_resumes_bitwise_without_duplicate_steps(workdir):
    # Two micro-batches per step (the accumulation resumes too); evaluation kept to one batch at
    # the checkpoints, where the kill and the resume happen.
    args = [o for o in LONGER if not o.startswith("train.eval_every")] + [
        "train.steps=40", "train.ckpt_every=10", "train.global_batch=16", "train.micro_batch=8",
        "train.eval_every=10", "train.eval_batches=1"]
    # The uninterrupted reference run.
    assert cli("workbench.run", args + [f"train.run_dir={workdir / 'ref'}"], workdir) \
        .returncode == 0
    ref = _runs()[0].info.run_id

    run_dir = workdir / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "workbench.run", *args,
                             f"train.run_dir={run_dir}"], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(run_dir, 10, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not _complete(run_dir, 40), "finished too early"
    killed = [r for r in _runs() if r.info.run_id != ref][0].info.run_id

    out = cli("workbench.run", [f"train.run_dir={run_dir}"], workdir)
    assert out.returncode == 0, out.stderr
    assert "resumed from checkpoint" in out.stderr
    assert len(_runs()) == 2  # the restart continued the same MLflow run
    for key in ("loss", "val_loss", "tokens_per_s"):
        got, want = metric_series(killed, key), metric_series(ref, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # no duplicated/missing step
        if key != "tokens_per_s":
            assert got == want, key
    from mlflow.tracking import MlflowClient

    assert MlflowClient().get_run(killed).info.status == "FINISHED"


def test_corrupt_checkpoint_falls_back_to_previous_good_one(workdir):
    run_dir = workdir / "run"
    args = FAST + ["train.ckpt_every=4", f"train.run_dir={run_dir}"]
    assert main(args) == 0
    run_id = _runs()[0].info.run_id
    before = metric_series(run_id, "loss")
    ckpts = sorted((run_dir / "checkpoints").glob("*/step_*"))
    assert [p.name for p in ckpts] == ["step_00000008", "step_00000012"]
    shard = max(ckpts[-1].glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    out = cli("workbench.train", [str(run_dir / "job.json")], workdir)
    assert out.returncode == 0, out.stderr
    assert f"step_00000012: {shard.name}: sha256 mismatch" in out.stderr
    assert "resumed from checkpoint at step 8" in out.stderr
    assert metric_series(run_id, "loss") == before

    # Truncate both: nothing valid is left, so it refuses rather than silently starting over.
    for p in sorted((run_dir / "checkpoints").glob("*/step_*/*.distcp")):
        p.write_bytes(p.read_bytes()[:100])
    out = cli("workbench.train", [str(run_dir / "job.json")], workdir)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no valid checkpoint" in out.stderr
    assert metric_series(run_id, "loss") == before


def test_a_resumed_run_refuses_overrides_its_job_file_does_not_hold(workdir, capsys):
    """`train.run_dir=DIR` on a run that exists resumes it as its job file says: an override
    asking for something else (more steps, another layout) ends in one line and exit 2 instead
    of being dropped, and leaves the run as it was; the same command resumes."""
    run_dir = workdir / "run"
    args = FAST + [f"train.run_dir={run_dir}"]
    assert main(args) == 0
    job_before = (run_dir / "job.json").read_text()
    for extra, key in ((["train.steps=20"], "train.steps=20"),
                       (["layout=fsdp"], "layout.name='fsdp'"),
                       (["model=gpt_small"], "model.name='gpt_small'")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as ended:
            main(args + extra)
        assert ended.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {key}: the run in "), err
        assert "job file defines it" in err[0]
    assert (run_dir / "job.json").read_text() == job_before
    assert len(_runs()) == 1 and len(metric_series(_runs()[0].info.run_id, "loss")) == 12
    assert main(args) == 0  # the same command: resumes (here re-finishes) the run
    assert len(_runs()) == 1
    # a job file written before keys it lacks existed: a group choice it ran still resumes
    import json

    old = json.loads(job_before)
    for key in ("mem_margin_gib", "check_memory"):
        del old["config"]["layout"][key]
    (run_dir / "job.json").write_text(json.dumps(old))
    assert main(args + ["layout=single"]) == 0 and len(_runs()) == 1
