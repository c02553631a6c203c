"""The torchrun launcher as a user runs it: the README's torchrun block (`python -m workbench.run
launcher=torchrun launcher.nproc_per_node=2 layout=ddp`, then two 4-rank layouts) trains through
the same rank entry point and writes ONE MLflow run per job (from the rank that holds the loss)
with world_size and the layout key, and measured metrics; an invalid layout exits 2 naming the
rule, before any process starts.

torchrun costs 10-20 s to start, so this file runs the README's block (test_readme leaves it
to this file) and no other job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, metric_series
from readme_blocks import block_with, make_clone, run_block

STEPS = 4
README_JOBS = "python -m workbench.run launcher=torchrun launcher.nproc_per_node=2 layout=ddp"
ARGS = ["launcher=torchrun", "launcher.nproc_per_node=2", "model=gpt_tiny",
        f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
        "train.eval_every=100", "train.eval_batches=1", "train.ckpt_every=100",
        "train.warmup_steps=1", "data.max_bytes=400000"]


@pytest.mark.slow
def test_the_readme_torchrun_jobs_write_one_mlflow_run_each(workdir, monkeypatch):
    """The README's torchrun block as a user types it (ddp on 2 ranks, fsdp_tp and an
    interleaved tp x pp on 4), at STEPS steps."""
    from mlflow.tracking import MlflowClient

    clone = make_clone(workdir)
    block = block_with(README_JOBS)
    proc = run_block(block, clone, [f"train.steps={STEPS}"])
    assert proc.returncode == 0, f"README {block.id} failed:\n{proc.stderr[-4000:]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{clone / 'mlflow.db'}")
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    # one run per job, never one per rank
    assert sorted(r.data.params["world_size"] for r in runs) == ["2", "4", "4"]
    assert all(r.info.status == "FINISHED" for r in runs)
    (run,) = [r for r in runs if r.data.params["world_size"] == "2"]
    assert run.data.params["layout"].startswith("dpr2_dps1_tp1_pp1_cp1")
    for key in ("loss", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes",
                "comm/allreduce_bytes", "comm/bytes_per_step"):
        assert [s for s, _ in metric_series(run.info.run_id, key)] == list(range(STEPS)), key
    run_dir = Path(run.data.tags["wb.run_dir"])
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["comm/allreduce_bytes"] > 0 and "val_loss" in final
    # DCP checkpoint of the final step, in the layout's folder.
    layout_dirs = list((run_dir / "checkpoints").iterdir())
    assert len(layout_dirs) == 1
    assert (layout_dirs[0] / f"step_{STEPS:08d}" / "complete.json").exists()


@pytest.mark.parametrize("overrides, key", [
    (["layout=tp", "layout.tp=3"], "layout"),  # 3 does not divide the world of 2
    (["layout=pp", "layout.pp=2", "model.n_layers=3"], "layout.pp"),
    # each cp rank holds two equal chunks: 2*cp must divide the sequence
    (["layout.cp=2", "model.seq_len=130"], "layout.cp"),
])
def test_invalid_layout_exits_2_before_any_process(workdir, overrides, key):
    proc = cli("workbench.run", ARGS + overrides + ["train.run_dir=bad"], workdir, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {key}"), last
    assert "torch.distributed.run" not in proc.stderr and not Path(workdir, "bad").exists()
