"""`+sweep=lowrank_vs_fullrank`, scaled down (a tiny model, a few dozen steps), end to end: DDP on
2 gloo ranks through torchrun, the four modes as child runs of one parent, measured bytes per
step, the switch window, and the comparison report attached to the parent. The sweep runs as
the README's own block (with its report and `lowrank_switch.py`), at this test's scale."""

from __future__ import annotations

import json

import pytest
from conftest import metric_series
from readme_blocks import block_with, make_clone, run_block

pytestmark = pytest.mark.slow

SMALL = ["model.n_layers=4", "model.hidden=64", "model.ffn_hidden=256", "model.seq_len=64",
         "train.steps=30", "train.global_batch=8", "train.micro_batch=4",
         "train.warmup_steps=3", "train.eval_every=10", "data.max_bytes=400000",
         "lowrank.keep_first_blocks=0", "lowrank.keep_last_blocks=0", "lowrank.check_every=2",
         "lowrank.powersgd_start_iter=5"]


def _logs(failed: dict) -> str:
    """The failed trials' own logs, so a failure in CI says what the ranks printed."""
    from pathlib import Path

    out = []
    for _, run_dir in failed.values():
        for log in sorted(Path(run_dir).glob("*.log")) + sorted(Path(run_dir).glob("*/*.log")):
            out.append(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def test_lowrank_sweep_on_two_ddp_ranks(workdir, monkeypatch):
    from mlflow.tracking import MlflowClient

    clone = make_clone(workdir)
    block = block_with("python -m workbench.run +sweep=lowrank_vs_fullrank")
    proc = run_block(block, clone, SMALL)
    assert proc.returncode == 0, f"README {block.id} failed:\n{proc.stderr[-4000:]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{clone / 'mlflow.db'}")
    sweep = clone / "sweeps" / "lowrank_vs_fullrank"
    trials = json.loads((sweep / "trials.json").read_text())
    failed = {n: (t.get("reason"), t["run_dir"]) for n, t in trials.items()
              if t["status"] != "complete"}
    assert not failed, f"{failed}\n{proc.stderr[-4000:]}\n{_logs(failed)}"
    assert len(trials) == 4
    runs = {t["params"]["lowrank.mode"]: t for t in trials.values()}
    c = MlflowClient()

    def series(mode, key):
        return [v for _, v in metric_series(runs[mode]["run_id"], key)]

    full = series("off", "comm/bytes_per_step")
    trainable_full = series("off", "params/trainable")[-1]
    # DDP's measured all-reduce is every gradient once (fp32) plus the 4-byte loss mean
    assert full[-1] == 4 * trainable_full + 4
    for mode in ("adaptive", "fixed"):
        with open(runs[mode]["run_dir"] + "/rank_map.json") as f:
            m = json.load(f)
        switch = m["switch_step"]
        cap = 0.5 if mode == "adaptive" else 0.25  # adaptive: max_switch_frac; fixed: 0.1
        assert 0.05 * 30 <= switch <= cap * 30, (mode, switch)
        bytes_ = series(mode, "comm/bytes_per_step")
        assert bytes_[switch - 1] == full[switch - 1]  # identical before the switch
        after = series(mode, "params/trainable")[-1]
        assert bytes_[-1] == 4 * after + 4 and bytes_[-1] < full[-1]
        rank_keys = [k for k in c.get_run(runs[mode]["run_id"]).data.metrics
                     if k.startswith("rank/")]
        assert len(rank_keys) == len(m["layers"]) > 0
    # fixed at rank ratio 0.25 on every block: well over 40% fewer bytes
    assert series("fixed", "comm/bytes_per_step")[-1] <= 0.6 * full[-1]
    # PowerSGD rank 4: full all-reduce before its start iteration, far less after
    psgd = series("powersgd", "comm/bytes_per_step")
    assert psgd[0] == full[0] and psgd[-1] < 0.2 * full[-1]
    # ... in one DDP bucket (parallelize.ddp_bucket_cap_mb): its three all-reduces and the loss
    assert series("powersgd", "comm/collectives_per_step")[-1] == 4
    # every mode logged val_loss at the same token budget; the parent holds the report
    assert all(len(series(m, "val_loss")) == 4 for m in runs)
    parent = json.loads((sweep / "plan.json").read_text())["parent_run_id"]
    files = {f.path for f in c.list_artifacts(parent, "report")}
    assert {"report/report.md", "report/report.html", "report/loss_vs_tokens.png",
            "report/signals_adaptive.png",
            "report/dp_scaling.png"} <= files  # the predicted DP scaling chart beside it
    # the adaptive run logged every switch signal of every layer it measured
    logged = c.get_run(runs["adaptive"]["run_id"]).data.metrics
    with open(runs["adaptive"]["run_dir"] + "/rank_map.json") as f:
        measured = json.load(f)["signals"]
    for sig in ("sr/", "lowrank/rank/", "lowrank/energy_rank/", "lowrank/overlap/",
                "lowrank/rate/"):
        assert {k[len(sig):] for k in logged if k.startswith(sig)} == set(measured), sig
    assert "lowrank/switch_forced" in logged
    md = (sweep / "report" / "report.md").read_text()
    assert all(f"| {m} |" in md for m in ("off", "adaptive", "fixed", "powersgd"))


@pytest.mark.parametrize("script,args,failed", [
    ("lowrank_switch.py", ["--steps", "12"], "FAIL  no switch forced by max_switch_frac"),
    ("lowrank_cpu.py", ["--steps", "12", "--modes", "off,adaptive", "model.n_layers=2",
                        "model.hidden=64", "model.ffn_hidden=256", "model.seq_len=64"],
     "FAIL  switch by the detector"),
    ("lowrank_heldout.py", ["--steps", "12", "--seeds", "11"],
     "FAIL  no switch forced by max_switch_frac"),
])
def test_a_lowrank_benchmark_whose_verdict_fails_exits_1(workdir, script, args, failed):
    """Twelve steps leave the detector no room: the cap forces the switch, the benchmark says
    FAIL and exits 1 (and with --smoke, the README's CI size, prints no verdict at all)."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args,
                           "--out", str(workdir / "out")], cwd=workdir, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert failed in proc.stdout
