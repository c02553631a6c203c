"""`python -m workbench.profile`: a cluster measured into the user's conf/, used like a shipped
cluster, refused where it is not valid, never left half-written; and the cost model reading its
curves (interpolation, the terms adding up to the measured parts)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, cli, only_run

from workbench.compose import compose
from workbench.config_rules import installed_torch
from workbench.layout import Layout
from workbench.plan.cost.engine_residuals import Residuals
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.measured import Measured, loglog
from workbench.plan.cost.shapes import block_key, model_shape
from workbench.train.counts import n_params


@pytest.mark.slow
def test_profile_writes_a_cluster_file_that_runs_and_plans_use(workdir):
    proc = cli("workbench.profile", ["cluster=local_cpu", "--name", "here", "--quick",
                                     "launcher=torchrun", "launcher.nproc_per_node=2"], workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile [" in proc.stderr  # progress while it runs
    assert "all_reduce x2 intra" in proc.stdout and "GEMM fp32" in proc.stdout
    path = workdir / "conf" / "cluster" / "here.yaml"
    data = yaml.safe_load(path.read_text())
    meta = data["profile"]["measured"]
    assert meta["world"] == 2 and meta["torch"] == installed_torch() and meta["when"]
    assert [lv["ranks"] for lv in data["profile"]["compute"]] == [1, 2]
    kinds = {(c["kind"], c["span"]) for c in data["profile"]["comms"]}
    assert kinds == {(k, "intra") for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    assert list(workdir.joinpath("conf", "cluster").iterdir()) == [path]
    # the engine probes of each degree alone and with the whole job busy (the cores shared)
    probes = data["profile"]["probes"][0]
    assert set(zip(probes["kind"], probes["degree"], probes["busy"])) >= {
        ("plain", 1, 1), ("plain", 1, 2), ("tp", 2, 2), ("ddp", 2, 2)}

    run = cli("workbench.run", ["cluster=here", "train.steps=3", "train.global_batch=4",
                                "data.max_bytes=1000000"], workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    r = only_run()
    assert r.data.params["cluster.name"] == "here" and r.data.metrics["pred/step_time_s"] > 0
    plan = cli("workbench.plan", ["cluster=here", "--explain", "dpr1_dps2_tp1_pp1_cp1_mb8_ga1"],
               workdir)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "measured (profile of" in plan.stdout

    # the GPU session's prediction check, on the CPU against this profile (a world of one)
    check = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_predict.py"),
                            "cluster=here", "--datasheet", "local_cpu", "--device", "cpu",
                            "--micro-batches", "2", "--steps", "3", "data.max_bytes=1000000"],
                           cwd=workdir, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "mb2 recompute=full" in check.stdout and "median |error|: profile" in check.stdout


def test_an_interrupted_profile_leaves_no_file(workdir):
    proc = subprocess.Popen([sys.executable, "-m", "workbench.profile", "--name", "cut"],
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ.copy(), start_new_session=True)
    try:
        assert proc.stderr is not None
        seen = ""
        for line in proc.stderr:  # wait until it is measuring
            seen += line
            if line.startswith("profile [") and "compute" in line:
                break
        assert proc.poll() is None, seen[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    folder = workdir / "conf" / "cluster"
    assert not folder.exists() or list(folder.iterdir()) == []


def _write_profile(workdir: Path, name: str, **meta) -> Path:
    """A small synthetic profile of gpt_tiny on this machine's torch (what a test can check
    by hand): every GEMM at 1e10 FLOP/s forward and half that backward, a block that is its
    GEMMs plus 1 ms forward and 2 ms backward, a loss of 0.5 ms each way, and collectives
    of 100 us plus 1 GB/s."""
    cfg = compose([])
    shape = model_shape(cfg.model)
    linears = list(shape.dense) + [(shape.hidden, shape.vocab, True)]
    tokens = [32, 512, 2048]
    gemm = {"dtype": "fp32", "k": [], "n": [], "tokens": [], "fwd_s": [], "bwd_s": []}
    block = {"model": "gpt_tiny", "shape": block_key(shape), "dtype": "fp32", "tp": [],
             "tokens": [], "fwd_s": [], "bwd_s": [], "loss_fwd_s": [], "loss_bwd_s": []}
    for tp in (1, 2):
        for m, n, col in linears:
            k, n_ = (m, n // tp) if col else (m // tp, n)
            for t in tokens:
                for key, v in zip(("k", "n", "tokens", "fwd_s", "bwd_s"),
                                  (k, n_, t, 2 * t * k * n_ / 1e10, 4 * 2 * t * k * n_ / 1e10)):
                    gemm[key].append(v)
        for t in tokens:
            f = sum(2 * t * (m if c else m // tp) * (n // tp if c else n) / 1e10
                    for m, n, c in shape.dense)
            for key, v in zip(("tp", "tokens", "fwd_s", "bwd_s", "loss_fwd_s", "loss_bwd_s"),
                              (tp, t, f + 1e-3, 4 * f + 2e-3, 5e-4, 5e-4)):
                block[key].append(v)
    sizes = [4096.0 * 4**i for i in range(6)]
    comms = [{"kind": k, "group": 2, "span": "intra", "bytes": sizes,
              "s": [1e-4 + b / 1e9 for b in sizes]}
             for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")]
    level = {"ranks": 1, "threads": 2, "elementwise": {"bytes": [1e3, 1e8], "s": [1e-6, 1e-2]},
             "gemm": [gemm], "blocks": [block],
             "optimizer": [{"model": "gpt_tiny", "params": 1e6, "tensors": 40, "step_s": 0.01}]}
    measured = {"when": "2026-12-04T00:00:00+00:00", "host": "test", "torch": installed_torch(),
                "device_type": "cpu", "device_name": "test cpu", "world": 2, "nodes": 1,
                "hosts": 1, "cores_per_host": 2, "ranks_per_host": 2, **meta}
    data = {**{k: v for k, v in asdict(cfg.cluster).items() if k not in ("pools", "links")},
            "name": name, "profile": {"measured": measured, "compute": [level], "comms": comms,
                                      "memory": {"model": "gpt_tiny", "micro_batch": 1,
                                                 "baseline_bytes": 2.0e8,
                                                 "step_peak_bytes": 3.0e8}}}
    path = workdir / "conf" / "cluster" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_loglog_passes_through_the_points_and_keeps_the_last_rate():
    xs, ys = np.array([1.0, 10.0, 100.0]), np.array([2.0, 4.0, 40.0])
    assert np.allclose(loglog(xs, xs, ys), ys)
    assert math.isclose(float(loglog(np.array([1000.0]), xs, ys)[0]), 400.0)
    assert math.isclose(float(loglog(np.array([0.5]), xs, ys)[0]), 2.0)
    mid = float(loglog(np.array([math.sqrt(10.0)]), xs, ys)[0])
    assert math.isclose(mid, math.sqrt(8.0), rel_tol=1e-9)


def test_a_residual_comes_from_the_probe_nearest_its_busy_ranks_scaled_only_beyond():
    tokens = np.array([100.0, 400.0])
    line = (tokens, np.array([1.0, 4.0]))
    res = Residuals(layer={("tp", 2, 2): line, ("tp", 2, 4): (tokens, 3 * line[1])},
                    micro_batch={}, cores=2)
    at = res.at("layer", "tp", np.full(4, 2.0), np.full(4, 100.0), np.array([2, 4, 8, 1.0]))
    # busy 2 and 4 read their own probes; 8 ranks on 2 cores oversubscribe twice as much as
    # the busy-4 probe did; one rank on two cores no less than the two-rank probe
    assert at.tolist() == [1.0, 3.0, 6.0, 1.0]
    assert res.at("layer", "cp", np.full(1, 2.0), np.full(1, 100.0), np.ones(1)).tolist() == [0]


def test_the_terms_on_a_profile_add_up_to_its_measured_parts(workdir):
    _write_profile(workdir, "syn")
    cfg = compose(["cluster=syn"])
    measured = Measured.of(cfg.cluster.profile)
    assert measured.one_host and measured.fixed_bytes == 2.0e8
    shape = model_shape(cfg.model)
    est = estimate(cfg.model, cfg.cluster, cfg.train, Layout(micro_batch=16))
    t = 16 * cfg.model.seq_len
    gemms = sum(2 * t * m * n / 1e10 for m, n, _ in shape.dense)
    head = 2 * t * shape.hidden * shape.vocab / 1e10
    fwd = 4 * (gemms + 1e-3) + head + 5e-4
    bwd = 4 * (4 * gemms + 2e-3) + 4 * head + 5e-4
    assert math.isclose(est.time_s["time_fwd_s"], fwd, rel_tol=0.01)
    assert math.isclose(est.time_s["time_bwd_s"], bwd, rel_tol=0.01)
    assert math.isclose(est.time_s["time_optimizer_s"], 0.01 / 1e6 * n_params(cfg.model),
                        rel_tol=0.01)
    assert est.mem_bytes["mem_fixed_bytes"] >= 2.0e8
    # DDP over 2 ranks: one all-reduce of the fp32 gradients at 100 us + bytes / 1 GB/s,
    # nothing hidden on a CPU
    ddp = estimate(cfg.model, cfg.cluster, cfg.train, Layout(dp_replicate=2, micro_batch=8))
    grads = 4.0 * n_params(cfg.model)
    assert ddp.time_s["time_dp_comm_exposed_s"] == pytest.approx(1e-4 + grads / 1e9, rel=0.05)
    datasheet = estimate(cfg.model, compose([]).cluster, cfg.train, Layout(micro_batch=16))
    assert datasheet.step_time_s != pytest.approx(est.step_time_s, rel=0.01)


@pytest.mark.parametrize("edit,key", [
    ({"torch": "1.0.0"}, "cluster.profile.measured.torch"),
    ({"device_type": "cuda"}, "cluster.profile.measured.device_type"),
])
def test_a_profile_from_another_torch_or_device_is_refused(workdir, edit, key):
    _write_profile(workdir, "other", **edit)
    proc = cli("workbench.run", ["cluster=other", "train.steps=1"], workdir)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}=")
    assert not (workdir / "mlflow.db").exists()


def test_a_malformed_profile_is_one_line(workdir):
    path = _write_profile(workdir, "broken")
    data = yaml.safe_load(path.read_text())
    data["profile"]["compute"][0]["gemm"][0]["fwd_s"].append(1.0)  # columns no longer line up
    path.write_text(yaml.safe_dump(data))
    proc = cli("workbench.run", ["cluster=broken", "train.steps=1"], workdir)
    assert proc.returncode == 2 and "must be non-empty lists of one length" in proc.stderr
    path.write_text("name: broken\nprofile: {compute: [1, 2\n")  # not YAML
    proc = cli("workbench.plan", ["cluster=broken"], workdir)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "broken.yaml:" in lines[0], lines


def test_the_users_conf_is_searched_first_and_a_name_in_both_is_an_error(workdir):
    user = workdir / "conf" / "model" / "mine.yaml"
    user.parent.mkdir(parents=True)
    user.write_text(yaml.safe_dump({**asdict(compose([]).model), "name": "mine",
                                    "n_layers": 2}))
    assert compose(["model=mine"]).model.n_layers == 2
    proc = cli("workbench.run", ["model=nope"], workdir)
    assert proc.returncode == 2 and "mine" in proc.stderr and "gpt_tiny" in proc.stderr
    (workdir / "conf" / "model" / "gpt_tiny.yaml").write_text(user.read_text())
    proc = cli("workbench.run", ["train.steps=1"], workdir)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "conf/model/gpt_tiny.yaml" in lines[0] and "workbench/conf/model/gpt_tiny.yaml" \
        in lines[0]


def test_profile_refuses_an_existing_file_and_a_bad_name(workdir):
    _write_profile(workdir, "taken")
    for args, expect in ((["--name", "taken"], "exists; --force replaces it"),
                         (["--name", "a/b"], "letters, digits")):
        t0 = time.monotonic()
        proc = cli("workbench.profile", args, workdir)
        assert proc.returncode == 2 and expect in proc.stderr, proc.stderr
        assert time.monotonic() - t0 < 60  # refused before anything is measured


def _probed_at_their_price(workdir: Path, world: int, kinds: tuple, above,
                           opt_above=None) -> tuple:
    """A profile ("bare") and the same with engine probes of `kinds` ((kind, degree) pairs),
    each probe step at exactly its price plus `above(kind, layers)` seconds, and with
    `opt_above` its optimizer step at its price plus `opt_above(kind, layers)` ("probed"): the
    residuals the cost model then reads are known."""
    from workbench.plan.cost.engine_residuals import PROBES, STEP_PARTS
    _write_profile(workdir, "bare", world=world)
    cfg = compose(["cluster=bare"])
    table: dict = {k: [] for k in ("kind", "degree", "busy", "layers", "micro_batch", "tokens",
                                   "step_s", "opt_s")}
    for kind, degree in kinds:
        for layers in (1, 3):
            for mb in (1, 4):
                est = estimate(replace(cfg.model, n_layers=layers), cfg.cluster, cfg.train,
                               replace(PROBES[kind](degree), micro_batch=mb))
                step = sum(est.time_s[k] for k in STEP_PARTS) + above(kind, layers)
                opt = est.time_s["time_optimizer_s"] + (opt_above or above)(kind, layers)
                for key, v in zip(table, (kind, degree, degree, layers, mb,
                                          mb * cfg.model.seq_len, step, opt)):
                    table[key].append(v)
    if opt_above is None:  # a profile before the optimizer's timing
        del table["opt_s"]
    path = _write_profile(workdir, "probed", world=world)
    data = yaml.safe_load(path.read_text())
    data["profile"]["probes"] = [{"model": "gpt_tiny", "shape": block_key(model_shape(cfg.model)),
                                  **table}]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return cfg, compose(["cluster=probed"]).cluster


def test_a_composed_probe_adds_what_composing_costs_beyond_its_kinds(workdir):
    """Single kinds probed at exactly their price (no residual) and DP x TP probed 2 ms a layer
    and 1 ms a micro-batch above it: a DP x TP layout is priced that much more, per layer and
    micro-batch, and layouts the composed probe does not describe are priced as before."""
    cfg, probed = _probed_at_their_price(
        workdir, 4, (("plain", 1), ("tp", 2), ("ddp", 2), ("ddp_tp", 4)),
        lambda kind, layers: layers * 2e-3 + 1e-3 if kind == "ddp_tp" else 0.0)

    def step_s(cluster, **layout) -> float:
        return estimate(cfg.model, cluster, cfg.train, Layout(**layout)).step_time_s

    composed = dict(dp_replicate=2, tp=2, micro_batch=4)
    assert math.isclose(step_s(probed, **composed) - step_s(cfg.cluster, **composed),
                        cfg.model.n_layers * 2e-3 + 1e-3, rel_tol=1e-6)
    for other in (dict(dp_replicate=2, micro_batch=4), dict(tp=2, micro_batch=4),
                  dict(dp_replicate=2, tp=2, pp=2, micro_batch=2, grad_accum=2),
                  dict(dp_shard=2, tp=2, micro_batch=4)):  # fsdp x tp: not probed here
        assert math.isclose(step_s(probed, **other), step_s(cfg.cluster, **other),
                            rel_tol=1e-9), other


def test_a_recomputed_forward_pays_tps_engine_cost_again_its_forward_share(workdir):
    """TP probed 3 ms a layer above its price (the engine's own cost: DTensor dispatch), every
    other probe at exactly its price: a TP layout is priced 3 ms a layer more, and with full
    recomputation a third more again, since the recomputed forward runs TP's forward (and its
    dispatch) once more; a layout without TP is priced as without the probes."""
    from workbench.plan.cost.communication import ENGINE_FORWARD_SHARE
    cfg, probed = _probed_at_their_price(
        workdir, 2, (("plain", 1), ("recompute", 1), ("tp", 2)),
        lambda kind, layers: layers * 3e-3 if kind == "tp" else 0.0)

    def extra_s(**layout) -> float:
        return (estimate(cfg.model, probed, cfg.train, Layout(**layout)).step_time_s
                - estimate(cfg.model, cfg.cluster, cfg.train, Layout(**layout)).step_time_s)

    per_layer = cfg.model.n_layers * 3e-3
    assert math.isclose(extra_s(tp=2, micro_batch=4, grad_accum=4), 4 * per_layer, rel_tol=1e-6)
    assert math.isclose(extra_s(tp=2, micro_batch=4, grad_accum=4, recompute="full"),
                        4 * per_layer * (1 + ENGINE_FORWARD_SHARE), rel_tol=1e-6)
    assert abs(extra_s(dp_replicate=2, micro_batch=8, recompute="full")) < 1e-9


def test_the_engines_optimizer_step_is_priced_as_its_probes_measured_it(workdir):
    """The plain probe's optimizer step 0.5 ms a layer + 2 ms above the priced update, TP's
    1 ms a layer + 6 ms above, DDP's at its price: one rank's step is priced the plain probe's
    more, TP's (its DTensors' clipping and AdamW) TP's, replication's none; the steps' own
    residuals are untouched (every probe step at its price)."""
    def opt_above(kind: str, layers: int) -> float:
        return {"plain": layers * 0.5e-3 + 2e-3, "tp": layers * 1e-3 + 6e-3}.get(kind, 0.0)

    cfg, probed = _probed_at_their_price(
        workdir, 2, (("plain", 1), ("tp", 2), ("ddp", 2)), lambda kind, layers: 0.0,
        opt_above)

    def extra_s(**layout) -> tuple:
        a, b = (estimate(cfg.model, c, cfg.train, Layout(**layout)) for c in (probed, cfg.cluster))
        return a.step_time_s - b.step_time_s, a.time_s["time_optimizer_s"] \
            - b.time_s["time_optimizer_s"]

    layers = cfg.model.n_layers
    for layout, expect in ((dict(micro_batch=16), layers * 0.5e-3 + 2e-3),
                           (dict(tp=2, micro_batch=8, grad_accum=2), layers * 1e-3 + 6e-3),
                           (dict(dp_replicate=2, micro_batch=8), 0.0)):
        step, optimizer = extra_s(**layout)
        assert math.isclose(optimizer, expect, abs_tol=1e-9), (layout, optimizer, expect)
        assert math.isclose(step, expect, abs_tol=1e-9), (layout, step, expect)


def test_a_probe_on_a_slower_machine_is_priced_at_the_speed_its_reference_measured(workdir):
    """Probes timed while the machine ran 1.5x slower than while its tables were timed (their
    compute 1.5x its price, their reference block 1.5x the table's): the engine's cost they
    carry is none, and a layout is priced as from probes at exactly their price; the same
    probes without their reference would put half the priced compute into the engine."""
    from workbench.plan.cost.engine_residuals import COMPUTE_PARTS, PROBES, STEP_PARTS
    _write_profile(workdir, "bare", world=2)
    cfg = compose(["cluster=bare"])
    key = block_key(model_shape(cfg.model))
    block = Measured.of(cfg.cluster.profile).level(2).blocks[(key, "fp32")]
    cols = ("kind", "degree", "busy", "layers", "micro_batch", "tokens", "step_s", "ref_s")
    table: dict = {k: [] for k in cols}
    for kind, degree in (("plain", 1), ("tp", 2), ("ddp", 2)):
        tp = np.array([float(PROBES[kind](degree).tp)])
        for layers in (1, 3):
            for mb in (1, 4):
                tokens = mb * cfg.model.seq_len
                est = estimate(replace(cfg.model, n_layers=layers), cfg.cluster, cfg.train,
                               replace(PROBES[kind](degree), micro_batch=mb))
                step = sum(est.time_s[k] * (1.5 if k in COMPUTE_PARTS else 1.0)
                           for k in STEP_PARTS)
                ref = 1.5 * float(sum(block.seconds(p, np.array([tokens]), tp)[0]
                                      for p in (1, 2)))
                for name, v in zip(cols, (kind, degree, degree, layers, mb, tokens, step, ref)):
                    table[name].append(v)

    def probed(name: str, columns: tuple) -> object:
        path = _write_profile(workdir, name, world=2)
        data = yaml.safe_load(path.read_text())
        data["profile"]["probes"] = [{"model": "gpt_tiny", "shape": key, "dtype": "fp32",
                                      **{c: table[c] for c in columns}}]
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return compose([f"cluster={name}"]).cluster

    with_ref, without = probed("with_ref", cols), probed("without_ref", cols[:-1])
    for layout in (dict(micro_batch=4), dict(dp_replicate=2, micro_batch=4),
                   dict(tp=2, micro_batch=2, grad_accum=2)):
        bare, fixed, off = (estimate(cfg.model, c, cfg.train, Layout(**layout)).step_time_s
                            for c in (cfg.cluster, with_ref, without))
        assert math.isclose(fixed, bare, rel_tol=1e-6), (layout, fixed, bare)
        # one rank pays the plain probe's per-micro-batch residual only; two, per layer too
        assert off > (1.01 if len(layout) == 1 else 1.3) * bare, (layout, off, bare)


def test_profile_repeatability_finds_the_section_two_profiles_differ_in(workdir):
    """Two profiles alike but for GEMMs 10% slower in one: the spread is in the compute
    section, none in the collectives; bad input is one line and exit 2."""
    script = [sys.executable, str(REPO / "benchmarks" / "profile_repeatability.py")]
    for i, slower in enumerate((1.0, 1.1)):
        path = _write_profile(workdir / f"profile{i}", "bench_here")
        data = yaml.safe_load(path.read_text())
        gemm = data["profile"]["compute"][0]["gemm"][0]
        gemm["fwd_s"] = [t * slower for t in gemm["fwd_s"]]
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = subprocess.run([*script, "--reuse", str(workdir)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the comms section of another profile moves profile 0's prices by 0.0%" in proc.stdout
    moved = re.search(r"the compute section .* by ([\d.]+)% \(median\)", proc.stdout)
    assert moved and 0.5 < float(moved.group(1)) < 10.0, proc.stdout[-2000:]
    for args, word in ((["--profiles", "1"], "--profiles"),
                       (["--reuse", str(workdir / "nothing")], "--reuse")):
        bad = subprocess.run([*script, *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and word in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_ranks_beyond_the_cores_keep_busy_until_rank_0_releases_them() -> None:
    """Where the ranks outnumber a CPU host's cores, one rank times and the others compute a
    block over and over until released; where each rank has a core (or a GPU of its own),
    they time side by side."""
    import torch

    from workbench.config import ModelConfig
    from workbench.profile.compute import keep_busy
    from workbench.profile.rank import cores, oversubscribed

    cpu = torch.device("cpu")
    assert oversubscribed(cores() + 1, cpu) and not oversubscribed(cores(), cpu)
    assert not oversubscribed(cores() + 1, torch.device("cuda"))
    polls = []
    model = ModelConfig(name="t", n_layers=1, hidden=32, n_heads=2, n_kv_heads=2,
                        ffn_hidden=64, vocab=64, seq_len=16)
    keep_busy(model, "fp32", cpu, 1, lambda: polls.append(1) or len(polls) > 3)
    assert len(polls) == 4  # three blocks computed, released at the fourth poll
