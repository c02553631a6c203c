"""The data-parallel scaling model (workbench.lowrank.dp_scaling), its chart, and the rate-limited
link the scaling benchmark measures over (workbench.testing.netns)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, need_service

from workbench.compose import compose
from workbench.lowrank import dp_scaling as dps


@pytest.mark.parametrize("name", ["gpt_small", "gpt_tiny"])
def test_payload_is_every_trainable_gradient_once(name):
    """The bytes the model predicts are the bytes the engine's counter measures for DDP: every
    parameter of the built model in fp32, plus the step's loss (4 bytes)."""
    from workbench.train.model import build

    model = compose([f"model={name}", "model.seq_len=128"]).model
    n = sum(p.numel() for p in build(model, 0).parameters())
    assert dps.dp_payload_bytes(dps.model_shape(model, None), "off") == 4 * n + 4


def test_powersgd_and_lowrank_bytes_match_the_measured_gpt_small():
    """comm/bytes_per_step measured by benchmarks/lowrank_scaling.py on gpt_small (seq 128)
    after the switch: fixed rank 0.25 and PowerSGD rank 4, to the byte."""
    model = compose(["model=gpt_small", "model.seq_len=128"]).model
    low = dps.model_shape(model, dps.lowrank_config("lowrank"))
    assert dps.dp_payload_bytes(low, "lowrank") == 30_833_668
    assert dps.dp_payload_bytes(dps.model_shape(model, None), "powersgd") == 1_065_988


def test_efficiency_orders_modes_and_links():
    """Where bytes are the bottleneck (100 Gbit/s per 8-GPU node) fewer bytes scale better;
    inside one node, and on 400 Gbit/s per GPU, full and low rank are close to ideal and
    PowerSGD's own compute (its hook) is what costs it."""
    from workbench.lowrank.dp_chart import load_model

    model = load_model("gpt2_124m")
    eth, ib = dps.gpu_network("eth", 100, 8), dps.gpu_network("ib", 400, 1)
    sizes = [8, 64, 1024]
    eff = {(mode, link.name): [p.efficiency for p in dps.gpu_curve(model, mode, link, sizes)]
           for mode in dps.MODES for link in (eth, ib)}
    for i in (1, 2):
        assert eff["off", "eth"][i] < eff["lowrank", "eth"][i] < eff["powersgd", "eth"][i]
        assert eff["off", "eth"][i] < 0.5 < eff["off", "ib"][i]
    assert min(eff[m, ln][0] for m in ("off", "lowrank") for ln in ("eth", "ib")) > 0.9
    assert eff["powersgd", "ib"][2] < eff["off", "ib"][2]  # the hook's passes over gradients


def test_cpu_prediction_counts_shared_cores():
    """Four one-thread ranks on two cores compute each step at half speed: with no bytes to
    send the efficiency is 1/2, with bytes it is lower."""
    link = dps.cpu_network(1000, overlap=0.0)
    idle = dps.predict(0.5, 0.33, 0.0, 4, link, slowdown=2.0)
    assert idle.efficiency == pytest.approx(0.5, rel=0.01)
    p = dps.predict(0.5, 0.33, 57e6, 2, link)
    assert p.allreduce_s == pytest.approx(57e6 / (1000e6 / 8 * dps.TCP_PAYLOAD_EFF), rel=0.01)
    assert p.efficiency < 0.55


def test_cpu_prediction_takes_the_cores_other_jobs_left():
    """A neighbour busy on one of two cores costs one rank nothing (it keeps a core) but
    stretches four ranks' compute from 2x to (4 + 1) / 2 = 2.5x the one-rank step."""
    from workbench.compose import compose

    model = compose(["model=gpt_small", "model.seq_len=128"]).model
    quiet = dps.cpu_prediction(model, "off", 0.4, 4, 1000, cores=2)
    busy = dps.cpu_prediction(model, "off", 0.4, 4, 1000, cores=2 * 4 / 5, cores_at_1=1.0)
    assert quiet.compute_s == pytest.approx(0.8) and busy.compute_s == pytest.approx(1.0)
    assert busy.allreduce_s == quiet.allreduce_s  # the link is the link
    # a one-rank step measured with less than a core is unstretched first
    assert dps.cpu_prediction(model, "off", 0.8, 4, 1000, cores=2, cores_at_1=0.5
                              ).compute_s == pytest.approx(0.8)


def test_slowest_of_is_the_median_of_the_slowest_rank():
    """n ranks that wait for each other every step take the slowest of n one-rank steps: the
    median of that maximum, drawn at random from a skewed step distribution, is what
    slowest_of reads off the sorted one-rank steps (the 0.5 ** (1 / n) quantile)."""
    import random

    rng = random.Random(0)
    steps = [0.4 + rng.expovariate(1 / 0.03) for _ in range(4001)]
    assert dps.slowest_of(steps, 1) == pytest.approx(sorted(steps)[2000])
    for n in (2, 4):
        worst = sorted(max(rng.choice(steps) for _ in range(n)) for _ in range(20001))
        assert dps.slowest_of(steps, n) == pytest.approx(worst[10000], rel=0.01)
    assert dps.slowest_of(steps, 4) > dps.slowest_of(steps, 2) > dps.slowest_of(steps, 1)
    assert dps.slowest_of([0.5] * 5, 4) == 0.5  # no spread, no wait


def test_collectives_per_step_follow_the_bucket_layout():
    """As the engine's counter measured them on gpt_small at 2 ranks (comm/collectives_per_step,
    benchmarks/lowrank_scaling.py): full rank 5 (DDP's buckets of 1 + 25 + 25 + 6 MB and the
    loss), PowerSGD 4 (one bucket: uncompressed tensors, P, Q, and the loss); a measured small
    all-reduce is every collective's latency in the prediction."""
    model = compose(["model=gpt_small", "model.seq_len=128"]).model
    full = dps.dp_payload_bytes(dps.model_shape(model, None), "off")
    assert dps.collectives(full, "off") == 5 and dps.collectives(1_065_988, "powersgd") == 4
    base = dps.cpu_prediction(model, "powersgd", 0.5, 2, 1000, cores=2)
    slow = dps.cpu_prediction(model, "powersgd", 0.5, 2, 1000, cores=2, collective_s=0.010)
    assert slow.allreduce_s - base.allreduce_s == pytest.approx(4 * (0.010 - 2 * 100e-6))


def test_benchmark_combines_runs_split_by_mode(tmp_path):
    """`lowrank_scaling.py --combine` (how the recorded points were measured: one invocation
    per pair of modes, each under 5 minutes) joins the runs' rows unchanged and refuses runs
    that measured the same mode twice."""
    import json

    from workbench.lowrank.dp_chart import MEASURED

    rec = json.loads(MEASURED.read_text())
    parts = []
    for i, modes in enumerate((("off", "powersgd"), ("adaptive", "fixed"))):
        part = {**rec, "rows": [r for r in rec["rows"] if r["mode"] in modes]}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    script = [sys.executable, str(REPO / "benchmarks" / "lowrank_scaling.py"), "--combine"]
    out = tmp_path / "combined.json"
    proc = subprocess.run([*script, *map(str, parts), "--json", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["rows"] == rec["rows"]
    assert "within 20% of measured" in proc.stdout
    twice = subprocess.run([*script, str(parts[0]), str(parts[0])], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert twice.returncode == 2 and "different modes" in twice.stderr


def test_the_scaling_benchmark_exits_1_when_its_verdict_fails(tmp_path):
    """A prediction 30% off the measurement fails the 20% check: FAIL printed, exit 1."""
    import json

    from workbench.lowrank.dp_chart import MEASURED

    rec = json.loads(MEASURED.read_text())
    rows = [{**r, **{k: 0.0 for k in ("error_pct", "oos_error_pct") if k in r}}
            for r in rec["rows"]]
    rows[1]["error_pct"] = 30.0  # full rank at 2 ranks
    part = tmp_path / "off.json"
    part.write_text(json.dumps({**rec, "rows": rows}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lowrank_scaling.py"),
                           "--combine", str(part), "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "FAIL  predicted tokens/s within 20% of measured (largest error 30%" in proc.stdout


def test_chart_is_written_into_the_sweep_report(tmp_path):
    """The sweep's report gets the chart (a prediction: seconds, no training)."""
    from workbench.sweep.lowrank import scaling_chart

    (tmp_path / "report.md").write_text("# Comparison\n")
    scaling_chart(tmp_path)
    assert (tmp_path / "dp_scaling.png").stat().st_size > 10_000
    assert "![dp_scaling.png](dp_scaling.png)" in (tmp_path / "report.md").read_text()


def test_chart_cli_rejects_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workbench.lowrank.dp_chart",
                           "--tokens-per-gpu", "0"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--tokens-per-gpu" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_benchmark_without_root_says_so_and_exits_2(tmp_path):
    """Run as nobody: one line naming what is missing, status 2."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        need_service("root and setpriv (util-linux)", "dropping to an unprivileged user")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, str(REPO / "benchmarks" / "lowrank_scaling.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "root" in proc.stderr


def test_limited_link_shapes_both_ways_and_cleans_up():
    """The link the benchmark measures over: the throughput follows the tc rate, and the
    namespaces are gone afterwards."""
    from workbench.testing import netns

    why = netns.unavailable_reason()
    if why:
        need_service("root and iproute2 (network namespaces + tc)", why)
    with netns.LimitedLink(2, 200) as link:
        slow = netns.probe_bytes_per_s(link, 4 << 20) * 8 / 1e6
        link.set_rate(800)
        fast = netns.probe_bytes_per_s(link, 16 << 20) * 8 / 1e6
        names = list(link.namespaces)
    assert 0.8 * 200 < slow < 1.05 * 200 and 0.8 * 800 < fast < 1.05 * 800, (slow, fast)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)


def _recorded_out() -> dict:
    import json

    from workbench.lowrank.dp_chart import MEASURED

    rec = json.loads(MEASURED.read_text())
    return {k: rec[k] for k in ("points", "cores", "host_copy_bytes_per_s", "powersgd_hook_s",
                                "collective_s")}


def test_the_4_rank_prediction_out_of_sample_uses_nothing_of_the_4_rank_run():
    """Beyond 2 ranks the scored prediction takes the cores the 2-rank run had; only the
    in-sample one (printed beside it) follows the cores the 4-rank run itself had."""
    import copy

    sys.path.insert(0, str(REPO / "benchmarks"))
    from lowrank_scaling_report import predict_all

    out = _recorded_out()
    base = predict_all(copy.deepcopy(out), ["off"], [1, 2, 4], 1000.0)[2]
    busy4 = copy.deepcopy(out)
    busy4["points"]["off/4"]["free_cores"] = 0.5  # other jobs took the cores during the 4-rank run
    r4 = predict_all(busy4, ["off"], [1, 2, 4], 1000.0)[2]
    assert r4["world"] == 4 and r4["oos_pred_step_s"] == base["oos_pred_step_s"]
    assert r4["pred_step_s"] > 1.5 * base["pred_step_s"]
    busy2 = copy.deepcopy(out)
    busy2["points"]["off/2"]["free_cores"] = 1.0
    r4 = predict_all(busy2, ["off"], [1, 2, 4], 1000.0)[2]
    assert r4["oos_pred_step_s"] > 1.3 * base["oos_pred_step_s"]  # compute 2x, not the link
    assert r4["oos_error_pct"] == pytest.approx(
        100 * (r4["step_s"] / r4["oos_pred_step_s"] - 1))
    assert "oos_pred_step_s" not in predict_all(copy.deepcopy(out), ["off"], [1, 2],
                                                1000.0)[1]


def test_the_scaling_verdict_scores_4_ranks_out_of_sample(capsys):
    """The table's 4-rank points are printed from 1-2 ranks beside the in-sample prediction,
    and the verdict's largest error is the out-of-sample one there."""
    import copy

    sys.path.insert(0, str(REPO / "benchmarks"))
    from lowrank_scaling_report import predict_all, report

    out = _recorded_out()
    rows = predict_all(copy.deepcopy(out), ["off", "powersgd"], [1, 2, 4], 1000.0)
    for r in rows:
        r["error_pct"] = 0.0
    rows[2]["oos_error_pct"] = 25.0  # off at 4 ranks: fine in sample, 25% out of sample
    assert report(rows, {**out, "probe_mbit": {}}, 1000.0) is False
    text = capsys.readouterr().out
    assert "off        4 ranks: predicted" in text and "powersgd   4 ranks: predicted" in text
    assert "FAIL  predicted tokens/s within 20% of measured (largest error 25%; beyond 2 " \
           "ranks from 1-2 ranks)" in text
