"""The torchrun launcher as a user runs it: `python -m workbench.run launcher=torchrun
launcher.nproc_per_node=2 layout=ddp` trains through the same rank entry point, writes ONE MLflow
run (from the rank that holds the loss) with world_size and the layout key, and measured
metrics; an invalid layout exits 2 naming the rule, before any process starts.

torchrun costs 10-20 s to start, so this file launches it once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, metric_series

STEPS = 4
ARGS = ["launcher=torchrun", "launcher.nproc_per_node=2", "model=gpt_tiny",
        f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
        "train.eval_every=100", "train.eval_batches=2", "train.ckpt_every=100",
        "train.warmup_steps=1", "data.max_bytes=400000"]


@pytest.mark.slow
def test_torchrun_ddp_writes_one_mlflow_run(workdir):
    from mlflow.tracking import MlflowClient

    proc = cli("workbench.run", ARGS + ["layout=ddp", "train.run_dir=run"], workdir,
               timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((workdir / "run" / "final_metrics.json").read_text())
    assert final["comm/allreduce_bytes"] > 0 and "val_loss" in final
    client = MlflowClient()
    exp = client.get_experiment_by_name("workbench")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # one run per job, never one per rank
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"
    assert run.data.params["layout"].startswith("dpr2_dps1_tp1_pp1_cp1")
    for key in ("loss", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes",
                "comm/allreduce_bytes", "comm/bytes_per_step"):
        assert [s for s, _ in metric_series(run.info.run_id, key)] == list(range(STEPS)), key
    # DCP checkpoint of the final step, in the layout's folder.
    layout_dirs = list((workdir / "run" / "checkpoints").iterdir())
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
