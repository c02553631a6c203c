"""The plan, validate and calibrate commands: outputs, and exit 2 with one line on bad input."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import published_layouts_csv

from workbench.cli import guarded
from workbench.config import CONF_DIR
from workbench.plan import __main__ as plan_main
from workbench.plan import calibrate, validate
from workbench.plan.accuracy.predict import PRED_COLUMNS

ROW = {"source": "t", "source_group": "t", "model": "m", "n_layers": "32", "hidden": "4096",
       "n_heads": "32", "n_kv_heads": "8", "ffn_hidden": "14336", "vocab": "128256",
       "seq_len": "8192", "n_params": "8B", "gpu_type": "H100 (80GB)", "n_gpus": "8",
       "gpus_per_node": "8", "interconnect": "", "tp": "1", "pp": "1", "dp": "8",
       "cp_or_sp": "none", "virtual_stages": "", "micro_batch": "1", "global_batch": "8",
       "recompute": "full", "zero_or_fsdp": "FSDP2", "precision": "BF16",
       "metric": "tokens_per_sec_per_gpu", "value": "6000", "metric2": "", "value2": "",
       "peak_mem_gib": "", "notes": "", "stack": "torchtitan"}


def write_csv(path: Path, rows) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(ROW))
        w.writeheader()
        w.writerows(rows)
    return path


def test_plan_prints_top_and_writes_csv(tmp_path, capsys) -> None:
    out = tmp_path / "rank.csv"
    rc = plan_main.main(["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=2",
                         "train.global_batch=64", "train.dtype=bf16", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "rejected:" in text and "tok/s/GPU" in text
    rows = list(csv.DictReader(out.open()))
    assert rows[0]["rank"] == "1" and any(r["rejected_because"] for r in rows)


def test_a_token_budget_prints_days_and_gpu_hours_per_layout(tmp_path, capsys) -> None:
    """--tokens: wall-clock and GPU-hours of each layout for a budget, from its tokens/s."""
    out = tmp_path / "rank.csv"
    args = ["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=2", "train.global_batch=64",
            "train.dtype=bf16"]
    assert plan_main.main(args + ["--out", str(out), "--tokens", "1e12", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "days for 1e+12" in text and "GPU-hours" in text
    rows = [r for r in csv.DictReader(out.open()) if r["fits"] == "true"]
    for r in rows[:50]:
        seconds = 1e12 / float(r["tokens_per_s"])
        assert float(r["days_for_tokens"]) == pytest.approx(seconds / 86400, rel=1e-5)
        assert float(r["gpu_hours_for_tokens"]) == pytest.approx(seconds * 16 / 3600, rel=1e-5)
    top = text.splitlines()[2].split()  # the best layout's line ends in days, GPU-hours
    assert float(top[-2]) == pytest.approx(float(rows[0]["days_for_tokens"]), abs=0.05)
    key = rows[0]["layout"]
    assert plan_main.main(args + ["--explain", key, "--tokens", "1e12"]) == 0
    days = f"{float(rows[0]['days_for_tokens']):.1f} days"
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"1e+12 tokens: {days}")


def test_validate_never_crashes_on_a_row(tmp_path) -> None:
    bad_gpu = {**ROW, "gpu_type": "TPU v5"}
    missing = {**ROW, "tp": ""}
    src = write_csv(tmp_path / "in.csv", [ROW, bad_gpu, missing])
    out = tmp_path / "out.csv"
    assert validate.main(["--csv", str(src), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert set(PRED_COLUMNS) <= set(rows[0]) and set(ROW) <= set(rows[0])
    assert rows[0]["pred_error"] == "" and float(rows[0]["pred_tokens_per_s_per_gpu"]) > 0
    assert rows[0]["pred_fits"] in ("true", "false") and 0 < float(rows[0]["pred_mfu"]) < 1
    assert "unknown GPU" in rows[1]["pred_error"] and "missing tp" in rows[2]["pred_error"]


def test_validate_published_file_when_present(tmp_path) -> None:
    published_layouts_csv()
    out = tmp_path / "pub.csv"
    assert validate.main(["--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert sum(1 for r in rows if not r["pred_error"]) >= 70


def test_calibrate_writes_coeff_to_a_copy(tmp_path) -> None:
    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    shutil.copy(CONF_DIR / "cluster" / "h100_80g_8x_ib.yaml", conf / "cluster")
    rows = [{**ROW, "value": v, "n_gpus": str(n), "dp": str(n), "global_batch": str(n)}
            for v, n in (("5000", 8), ("4800", 16))]
    src = write_csv(tmp_path / "m.csv", rows)
    assert calibrate.main(["--cluster", "h100_80g_8x_ib", "--csv", str(src), "--conf-dir",
                           str(conf), "--fit", "mm_eff_max"]) == 0
    text = (conf / "cluster" / "h100_80g_8x_ib.yaml").read_text()
    assert text.startswith("# DGX H100") and "coeff:" in text and "mm_eff_max:" in text
    from workbench.plan.calibrate import _load_cluster

    assert "mm_eff_max" in _load_cluster(conf / "cluster" / "h100_80g_8x_ib.yaml").coeff


@pytest.mark.parametrize("module,args", [
    ("workbench.plan", ["model=nope"]),
    ("workbench.plan", ["--bogus"]),
    ("workbench.plan", ["cluster.nodes"]),
    ("workbench.plan", ["model=llama3_8b", "--explain", "tp8_bogus"]),
    ("workbench.plan", ["model=llama3_8b", "--explain", "tp3_mb1"]),
    ("workbench.plan", ["model=llama3_8b", "--explain", "tp2_mb1", "--margin-gib", "-1"]),
    ("workbench.plan", ["model=llama3_8b", "--margin-gib", "nan"]),
    ("workbench.plan", ["model=llama3_8b", "--top", "-1"]),
    ("workbench.plan", ["model=llama3_8b", "--world-size", "-8"]),
    ("workbench.plan", ["model=llama3_8b", "--optuna", "-5"]),
    ("workbench.plan", ["model=llama3_8b", "--tokens", "-1e12"]),
    # a key of another world size (16 GPUs where the cluster has 8) or global batch (8, not 16)
    ("workbench.plan", ["model=llama3_8b", "--explain", "dpr1_dps16_tp1_pp1_cp1_mb1_ga1_rc-none"]),
    ("workbench.plan", ["model=llama3_8b", "--explain", "dpr1_dps8_tp1_pp1_cp1_mb1_ga1_rc-none"]),
    ("workbench.plan.validate", ["--csv", "/no/such.csv", "--out", "/tmp/x.csv"]),
    ("workbench.plan.validate", ["--nope"]),
    ("workbench.plan.calibrate", ["--cluster", "nope", "--csv", "/no/such.csv"]),
    ("workbench.plan.calibrate", ["--cluster", "h100_8x_ib", "--csv", "x", "--fit", "zz"]),
])
def test_bad_input_exits_2_with_one_line(module, args, tmp_path) -> None:
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                       check=False, cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_margin_rejects_exactly_the_layouts_that_leave_too_little_free(tmp_path, capsys) -> None:
    """`--margin-gib G` holds for the ranking and the Optuna search, not only --explain: a layout
    that fits with less than G GiB free is rejected under a reason of its own, and every other
    layout keeps its place; a user who trusts the memory model less gets a ranking that says so."""
    from workbench.compose import compose
    from workbench.plan.cost.hardware import GIB
    from workbench.plan.search.exhaustive import NOT_FIT, REASONS, UNDER_MARGIN, rank_layouts
    from workbench.plan.search.optuna_search import optuna_search

    cfg = compose(["model=llama3_8b", "cluster=h100_8x_ib", "train.dtype=bf16",
                   "train.global_batch=32"])
    margin = 4 * GIB
    r0 = rank_layouts(cfg.model, cfg.cluster, cfg.train, 8)
    r4 = rank_layouts(cfg.model, cfg.cluster, cfg.train, 8, margin_bytes=margin)
    tight = [int(i) for i in r0.order if r0.hbm_bytes - r0.peak_mem_bytes[i] < margin]
    assert 0 < len(tight) < len(r0.order)
    assert list(r4.order) == [i for i in r0.order if i not in tight]
    assert {r4.reason_of(i) for i in tight} == {UNDER_MARGIN}
    not_fit = REASONS.index(NOT_FIT)
    assert (r4.reason == not_fit).sum() == (r0.reason == not_fit).sum()
    res = optuna_search(cfg.model, cfg.cluster, cfg.train, 8, 12, 0, margin_bytes=margin)
    assert res.layout is not None
    assert res.layout.key() in {r4.layout(int(i)).key() for i in r4.order}
    out_csv = tmp_path / "rank.csv"
    assert plan_main.main(["model=llama3_8b", "cluster=h100_8x_ib", "train.dtype=bf16",
                           "train.global_batch=32", "--margin-gib", "4", "--top", "3",
                           "--out", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert f"{len(r4.order)} feasible (peak + 4 GiB margin within 80.0 GiB)" in out
    assert f"{len(tight):>9}  {UNDER_MARGIN}" in out
    with out_csv.open() as fh:
        rows = list(csv.DictReader(fh))
    assert all(float(r["peak_mem_gib"]) <= 76.0 + 1e-3 for r in rows if r["fits"] == "true")
    assert sum(r["rejected_because"] == UNDER_MARGIN for r in rows) == len(tight)


@pytest.mark.parametrize("key", [
    "dpr1_dps16_tp1_pp1_cp1_mb1_ga1_rc-selective",  # FSDP: gathered-block buffers, logits
    "dpr2_dps1_tp4_pp2_cp1_sp_mb1_ga8_rc-none_1f1b-v1",  # replicated states, p2p, last stage
    "dpr1_dps2_tp2_pp2_cp2_sp_mb1_ga8_rc-full_interleaved-1f1b-v2",  # CP, recompute layer
])
def test_explain_parts_sum_to_the_total(key: str, capsys) -> None:
    """The itemization a user reads must add up to the peak the ranking compares with HBM."""
    from workbench.compose import compose
    from workbench.layout import Layout
    from workbench.plan.cost.estimate import estimate
    from workbench.plan.cost.explain import explain

    cfg = compose(["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=2", "train.dtype=bf16"])
    x = explain(cfg.model, cfg.cluster, cfg.train, key, margin_gib=2.0)
    assert sum(x.memory_bytes.values()) == pytest.approx(x.peak_bytes, rel=1e-12)
    assert all(v >= 0 for v in x.memory_bytes.values()), x.memory_bytes
    est = estimate(cfg.model, cfg.cluster, cfg.train, Layout.from_key(key))
    assert x.peak_bytes == pytest.approx(est.peak_mem_bytes, rel=1e-12)
    assert sum(x.time_s.values()) == pytest.approx(x.step_time_s, rel=1e-12)
    assert x.fits == (est.peak_mem_bytes + 2 * 2**30 <= est.hbm_bytes)
    rc = plan_main.main(["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=2",
                         "train.dtype=bf16", "--explain", key, "--margin-gib", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "optimizer states" in out and "fragmentation" in out
    assert f"{x.peak_bytes / 2**30:.2f} GiB" in out


def test_unparseable_csv_exits_2(tmp_path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    p = subprocess.run([sys.executable, "-m", "workbench.plan.validate", "--csv", str(bad),
                        "--out", str(tmp_path / "o.csv")], capture_output=True, text=True,
                       check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: ")
    assert not (tmp_path / "o.csv").exists()


def test_calibrate_from_mlflow_recovers_a_known_coefficient(tmp_path, capsys) -> None:
    """Runs in a real sqlite MLflow store, measured = the model's prediction at mm_eff_max=0.5
    (x a little noise), so the fit must move the H100 default (0.66) back to about 0.5."""
    import warnings
    from dataclasses import replace

    from mlflow.tracking import MlflowClient

    from workbench.compose import compose
    from workbench.layout import Layout
    from workbench.plan.cost.coefficients import coefficients
    from workbench.plan.cost.estimate import estimate
    from workbench.plan.cost.stacks import software_for

    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    shutil.copy(CONF_DIR / "cluster" / "h100_80g_8x_ib.yaml", conf / "cluster")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("cal", artifact_location=str(tmp_path / "art"))
        for gb, key in ((16, "dpr1_dps8_tp1_pp1_cp1_mb1_ga2_rc-full"),
                        (32, "dpr1_dps4_tp2_pp1_cp1_sp_mb2_ga4_rc-selective"),
                        (16, "dpr2_dps1_tp4_pp1_cp1_sp_mb1_ga8_rc-none")):
            cfg = compose(["model=llama3_8b", "cluster=h100_80g_8x_ib",
                           f"train.global_batch={gb}"])
            lay = Layout.from_key(key)
            truth = replace(coefficients(cfg.cluster), mm_eff_max=0.5)
            est = estimate(cfg.model, cfg.cluster, cfg.train, lay)
            meas = estimate(cfg.model, cfg.cluster, cfg.train, lay, coeff=truth).step_time_s
            assert software_for(cfg.train, cfg.cluster).precision == "bf16"
            run = client.create_run(exp).info.run_id
            params = {f"model.{k}": v for k, v in vars(cfg.model).items()}
            params |= {f"train.{k}": v for k, v in vars(cfg.train).items()}
            params |= {"cluster.gpu": cfg.cluster.gpu, "cluster.name": cfg.cluster.name,
                       "layout": key}
            for k, v in params.items():
                client.log_param(run, k, v)
            for name, v in est.as_metrics().items():
                client.log_metric(run, f"pred/{name}", v, step=0)
            for step, f in enumerate((3.0, 1.01, 0.99, 1.0)):  # step 0 is warm-up
                client.log_metric(run, "step_time_s", meas * f, step=step)
            client.set_terminated(run)
        client.create_run(exp)  # a run without predictions is skipped, not fatal
    rc = calibrate.main(["--cluster", "h100_80g_8x_ib", "--mlflow-uri", uri, "--experiment",
                         "cal", "--conf-dir", str(conf), "--fit", "mm_eff_max"])
    assert rc == 0
    from workbench.plan.calibrate import _load_cluster

    fitted = _load_cluster(conf / "cluster" / "h100_80g_8x_ib.yaml").coeff["mm_eff_max"]
    assert abs(fitted - 0.5) < 0.01

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # bad input: exit 2, one line naming the experiment
        guarded(calibrate.main)(["--cluster", "h100_80g_8x_ib", "--mlflow-uri", uri,
                                 "--experiment", "nope", "--conf-dir", str(conf), "--dry-run"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0]


def test_explain_shows_the_bandwidth_each_group_gets(capsys) -> None:
    """--explain names the links the time terms used: a group inside a node gets NVLink; a
    data-parallel group of 16 ranks 2 apart on 4 H100 nodes gets 4 NICs per node (one ring per
    member on a node), and the pipeline send between two nodes one NIC."""
    from workbench.compose import compose
    from workbench.plan.cost.coefficients import coefficients
    from workbench.plan.cost.explain import explain
    from workbench.plan.cost.hardware import hardware_for

    cfg = compose(["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=4", "train.dtype=bf16"])
    hw, co = hardware_for(cfg.cluster), coefficients(cfg.cluster)
    x = explain(cfg.model, cfg.cluster, cfg.train, "dpr16_dps1_tp2_pp1_cp1_mb1_ga1_rc-none")
    tp, dp = x.paths["tensor parallel"], x.paths["data parallel, replicated"]
    assert (tp.size, tp.nodes, tp.nics) == (2, 1, 0)
    assert tp.bytes_per_s == pytest.approx(hw.intra_node_gbps * co.link_eff_intra * 1e9)
    assert (dp.size, dp.stride, dp.nodes, dp.nics) == (16, 2, 4, 4)
    assert dp.bytes_per_s == pytest.approx(4 * hw.inter_node_gbps * co.link_eff_inter * 1e9)
    assert set(x.paths) == {"tensor parallel", "data parallel, replicated"}
    pp = explain(cfg.model, cfg.cluster, cfg.train, "dpr1_dps8_tp2_pp2_cp1_mb1_ga2_rc-none"
                 ).paths["pipeline send"]
    assert (pp.size, pp.stride, pp.nics) == (2, 16, 1)
    assert plan_main.main(["model=llama3_8b", "cluster=h100_8x_ib", "cluster.nodes=4",
                           "train.dtype=bf16", "--explain",
                           "dpr16_dps1_tp2_pp1_cp1_mb1_ga1_rc-none"]) == 0
    out = capsys.readouterr().out
    assert "data parallel, replicated     16 ranks over 4 nodes, 4 NICs per node" in out
