"""The README's main job: the embedded default trains, learns and records every metric; data
shards built by workbench.data.prepare train too."""

from __future__ import annotations

from conftest import FAST, cli, metric_series, only_run

REQUIRED = ("loss", "val_loss", "lr", "tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes")


def test_default_run_learns_and_records_every_metric(workdir):
    out = cli("workbench.run", [], workdir)
    assert out.returncode == 0, out.stderr
    assert "mlflow ui --backend-store-uri" in out.stdout and "--host 127.0.0.1" in out.stdout
    run = only_run()
    for key in REQUIRED:
        assert key in run.data.metrics, key
    losses = metric_series(run.info.run_id, "loss")
    assert [s for s, _ in losses] == list(range(300))
    val = metric_series(run.info.run_id, "val_loss")
    assert val[-1][1] <= 0.8 * val[0][1], val
    assert run.data.params["model.name"] == "gpt_tiny"
    assert run.data.tags["wb.layout"].startswith("dpr1_dps1_tp1")
    assert run.info.status == "FINISHED"


def test_prepare_builds_shards_that_train(workdir):
    src = workdir / "texts"
    src.mkdir()
    for i in range(30):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * 400)
    out = cli("workbench.data.prepare", [str(src), str(workdir / "shards")], workdir)
    assert out.returncode == 0, out.stderr
    assert (workdir / "shards" / "meta.json").exists()
    out = cli("workbench.run", FAST + ["data=tokens", f"data.path={workdir / 'shards'}"],
              workdir)
    assert out.returncode == 0, out.stderr


def test_missing_inputs_exit_2_with_one_line(workdir):
    for module, args in [("workbench.data.prepare", ["/no/such/folder", "out"]),
                         ("workbench.run", ["data=tokens", "data.path=/no/such/shards"]),
                         ("workbench.train", ["/no/such/job.json"]),
                         ("workbench.rerun", ["0123456789abcdef"])]:
        out = cli(module, args, workdir)
        assert out.returncode == 2, (module, out.stderr)
        lines = [ln for ln in out.stderr.splitlines() if "INFO" not in ln]
        assert len(lines) == 1 and lines[0].startswith("error:"), (module, out.stderr)


def test_a_layout_predicted_not_to_fit_is_refused_and_a_failed_build_is_recorded(workdir):
    """Llama 3 8B on one CPU process: the cost model predicts ~1.3 TB for 22 GiB, so the run is
    refused in one line before anything is recorded. Forced (layout.check_memory=false) under
    an 8 GB address-space limit, building the model fails; the MLflow run says FAILED, not
    RUNNING forever."""
    import resource
    import subprocess
    import sys

    out = cli("workbench.run", ["model=llama3_8b", "train.steps=1"], workdir)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: layout=") and "predicted peak" in lines[0]
    assert "layout.check_memory=false" in lines[0]
    assert not (workdir / "mlflow.db").exists() and not (workdir / "runs").exists()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    forced = subprocess.run([sys.executable, "-m", "workbench.run", "model=llama3_8b",
                             "train.steps=1", "layout.check_memory=false"], cwd=workdir,
                            capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert forced.returncode != 0 and "allocate" in forced.stderr, forced.stderr[-2000:]
    run = only_run()
    assert run.info.status == "FAILED" and run.data.params["model.name"] == "llama3_8b"


def test_cpu_ranks_on_one_machine_share_its_memory() -> None:
    """GPT-2 124M under DDP on two CPU ranks: each is predicted ~13 GiB, which fits the host's
    22.4 GiB alone but not twice over on one machine; two machines, or GPUs, hold one each."""
    import pytest

    from workbench.compose import compose
    from workbench.errors import ConfigError
    from workbench.submit import check_fits, choose_layout

    base = ["model=gpt2_124m", "launcher=torchrun", "launcher.nproc_per_node=2", "layout=ddp"]
    cfg = compose(base)
    with pytest.raises(ConfigError, match="x 2 ranks on one machine"):
        check_fits(cfg, choose_layout(cfg, 2))
    two = compose(base + ["launcher.nodes=2", "launcher.nproc_per_node=1"])
    check_fits(two, choose_layout(two, 2))
    gpus = compose(base + ["cluster.device=cuda"])
    check_fits(gpus, choose_layout(gpus, 2))
