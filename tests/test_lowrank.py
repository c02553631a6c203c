"""Low-rank training, single process: the factorization, the stable-rank estimate, the rank rule,
the switch detector, byte accounting, and bitwise resume across the switch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from workbench.config import LowRankConfig, ModelConfig
from workbench.lowrank import factorize as F
from workbench.lowrank import ranks as R
from workbench.lowrank.detector import SwitchDetector, should_switch


def test_svd_conversion_is_exact_at_full_rank():
    torch.manual_seed(0)
    lin = nn.Linear(48, 32, bias=True)
    low = F.factorize(lin, 32)
    x = torch.randn(5, 48)
    torch.testing.assert_close(low(x), lin(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(low.product(), lin.weight.detach(), atol=1e-5, rtol=1e-5)
    # the factors share sqrt(S): both have the same singular values
    su, sv = torch.linalg.svdvals(low.u.weight), torch.linalg.svdvals(low.v.weight)
    torch.testing.assert_close(su, sv, atol=1e-4, rtol=1e-4)


def test_truncated_conversion_is_the_best_rank_r_approximation():
    torch.manual_seed(1)
    lin = nn.Linear(40, 30, bias=False)
    s = torch.linalg.svdvals(lin.weight.detach().double())
    err = (F.factorize(lin, 10).product().double() - lin.weight.detach().double()).norm()
    assert math.isclose(float(err), float(s[10:].pow(2).sum().sqrt()), rel_tol=1e-4)


def test_stable_rank_of_a_gaussian_matrix():
    g = torch.Generator().manual_seed(0)
    m, n = 1024, 256
    w = torch.randn(m, n, generator=g)
    expected = m * n / (math.sqrt(m) + math.sqrt(n)) ** 2
    assert abs(F.stable_rank(w) / expected - 1) < 0.02
    probe = F.StableRankProbe(n, seed=3)  # warm-started: repeated checks converge
    for _ in range(20):
        est = probe(w, iters=2)
    assert abs(est / expected - 1) < 0.02


def test_stable_rank_of_equal_singular_values_is_k():
    g = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    for k in (1, 5, 17):
        w = 3.0 * q1[:, :k] @ q2[:, :k].T
        assert F.stable_rank(w) == pytest.approx(k, abs=1e-9)
        assert F.StableRankProbe(48, seed=k)(w, iters=2) == pytest.approx(k, abs=1e-9)


def test_switch_detector_fires_on_a_plateau():
    det = SwitchDetector(ema=0.8, window=5, epsilon=0.02)
    fired = None
    for i in range(60):
        sr = 100.0 * math.exp(-i / 4) + 20.0  # a fast drop, then flat
        det.observe({"a": sr, "b": sr / 2})
        if det.settled():
            fired = i
            break
    assert fired is not None and 5 < fired < 60


def test_switch_detector_never_fires_on_a_steady_ramp():
    det = SwitchDetector(ema=0.8, window=5, epsilon=0.02)
    for i in range(500):
        det.observe({"a": 100.0 + 2.5 * i, "b": 50.0})  # a: 2.5% of its start per check
        assert not det.settled(), i
    # the bounds: never before min_frac, always from max_frac, the detector in between
    assert not should_switch(det, 3, 100, 0.05, 0.25)
    assert not should_switch(det, 20, 100, 0.05, 0.25)
    assert should_switch(det, 24, 100, 0.05, 0.25)


def test_rank_rule_clips_and_rounds():
    assert R.adaptive_rank(2.0, 10.0, 256, 128, 0.05) == 20
    assert R.adaptive_rank(2.0, 1.0, 256, 128, 0.05) == 7  # ceil(0.05 * 128)
    assert R.adaptive_rank(4.0, 100.0, 256, 128, 0.05) == 128
    assert R.adaptive_rank(2.0, 10.1, 256, 128, 0.05, multiple=8) == 24
    assert R.fixed_rank(0.25, 384, 1536) == 96


def test_no_gain_guard():
    assert R.no_gain(64, 128, 128) and not R.no_gain(63, 128, 128)
    cfg = LowRankConfig(mode="fixed", rank_ratio=0.6)
    layers = [R.LayerShape("sq", 128, 128), R.LayerShape("wide", 512, 128)]
    # rank 77 of a 128x128 layer would hold more than the layer: it stays dense
    assert R.rank_map_for("fixed", cfg, layers, {}, {}) == {"wide": 77}


def _tiny(n_layers: int = 4, tie: bool = False) -> ModelConfig:
    return ModelConfig(name="t", family="llama", n_layers=n_layers, hidden=64, n_heads=4,
                       n_kv_heads=4, ffn_hidden=192, vocab=256, seq_len=32,
                       tie_embeddings=tie)


def test_candidates_skip_embeddings_head_norms_and_outer_blocks():
    from workbench.train.model import build

    model = build(_tiny(5), seed=0)
    names = [n for n, _ in F.candidates(model, LowRankConfig(keep_first_blocks=1,
                                                              keep_last_blocks=2), 5)]
    assert {n.split(".")[1] for n in names} == {"1", "2"}
    assert len(names) == 2 * 7 and not any("embed" in n or "output" in n for n in names)


def test_byte_accounting():
    from workbench.train.model import build, n_params

    cfg = _tiny(4, tie=True)
    model = build(cfg, seed=0)
    assert F.trainable_params(model) == n_params(cfg)  # tied head counted once
    assert F.dp_grad_bytes(model) == 4 * n_params(cfg)
    low = F.LowRankLinear(64, 192, 8, bias=True)
    assert F.trainable_params(low) == 8 * (64 + 192) + 192
    before = F.trainable_params(model)
    F.convert(model, {"layers.1.feed_forward.w1": 8})  # 64 -> 192 dense becomes rank 8
    assert F.trainable_params(model) == before - 64 * 192 + 8 * (64 + 192)
    assert F.dp_grad_bytes(model, bytes_per_elem=2) == 2 * F.trainable_params(model)


def test_tp_plan_shards_factors_like_their_base():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from workbench.train.model import build

    model = build(_tiny(3), seed=0)
    F.convert(model, {"layers.1.attention.wq": 4, "layers.1.attention.wo": 4})
    plan = {"layers.1.attention.wq": ColwiseParallel(), "layers.1.attention.wo":
            RowwiseParallel(), "layers.1.attention.wk": ColwiseParallel()}
    out = F.adapt_tp_plan(model, plan, sequence_parallel=False)
    assert set(out) == {"layers.1.attention.wq.u", "layers.1.attention.wo.v",
                        "layers.1.attention.wk"}
    assert isinstance(out["layers.1.attention.wq.u"], ColwiseParallel)
    assert isinstance(out["layers.1.attention.wo.v"], RowwiseParallel)


# ------------------------------------------------------------------ in the training loop
TINY = ["model.n_layers=4", "model.hidden=64", "model.ffn_hidden=192", "model.seq_len=64",
        "train.global_batch=4", "train.micro_batch=4", "train.warmup_steps=3",
        "train.eval_every=10", "train.ckpt_every=1000", "data.max_bytes=400000",
        "tracking=none", "lowrank=adaptive", "lowrank.check_every=2", "lowrank.window=3",
        "lowrank.keep_first_blocks=0", "lowrank.keep_last_blocks=0"]


def _train(run_dir, steps: int, stop_after=None):
    from workbench.submit import start
    from workbench.train.main import run_job

    _, job = start(TINY + [f"train.steps={steps}", f"train.run_dir={run_dir}"])
    stop = None
    if stop_after is not None:
        calls = itertools.count()
        def stop() -> bool:
            return next(calls) >= stop_after
    return run_job(job, progress=False, stop_requested=stop)


def _final_state(run_dir, steps):
    return torch.load(run_dir / "checkpoints" / f"step_{steps:08d}.pt", weights_only=False)


def test_switch_happens_and_resume_across_it_is_bitwise(workdir):
    import json

    ref = _train(workdir / "ref", 40)
    rank_map = json.loads((workdir / "ref" / "rank_map.json").read_text())
    switch = rank_map["switch_step"]
    assert 0.05 * 40 <= switch <= 0.25 * 40 and rank_map["layers"]
    assert (workdir / "ref" / "stable_rank.png").stat().st_size > 1000
    from dataclasses import replace

    from workbench.train.model import n_params

    assert ref["params/trainable"] < n_params(replace(_tiny(4), seq_len=64))
    # stop before the switch, resume, stop after it, resume to the end
    run = workdir / "resumed"
    first = _train(run, 40, stop_after=switch - 3)
    assert first["stopped_at"] < switch
    second = _train(run, 40, stop_after=8)
    assert second["stopped_at"] > switch
    last = _train(run, 40)
    for key in ("loss", "val_loss", "params/trainable"):
        assert last[key] == ref[key], key
    a, b = _final_state(workdir / "ref", 40), _final_state(run, 40)
    assert a["lowrank"]["rank_map"] == b["lowrank"]["rank_map"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
