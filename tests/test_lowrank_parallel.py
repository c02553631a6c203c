"""Fixed low-rank training after the switch under FSDP2 (dp_shard=2), tensor parallelism (tp=2, no
sequence parallel) and context parallelism (cp=2) on 2 gloo ranks: the low-rank hooks rebuild the
engine from a full state dict and parallelizes the factorized model again. Per-step losses equal
the single-process run of the same config (1e-4 relative), the switch happens at the same step,
and FSDP moves fewer bytes per step once the blocks are factorized.

All layouts run inside ONE spawned process group (workbench.testing.multirank), as in
test_parallel.py."""

from __future__ import annotations

import statistics
from typing import Dict, List

import pytest

from workbench import layout as layouts
from workbench.compose import compose
from workbench.data.corpus import load as load_data
from workbench.plan.search.rules import validate_layout
from workbench.testing.multirank import Case, run_cases, run_single

pytestmark = pytest.mark.slow

REL_TOL = 1e-4
# Gradient norms: the rewarm after the switch makes a loss spike (steps 5-6), where the norm is
# sensitive to summation order: measured there TP 2.5e-4, CP 1.3e-3 (step 6 on an AVX-512 CPU,
# where the losses still agree to 1e-6; dense TP: 1e-6). Elsewhere ~1e-6, so the median over the
# steps is held tight: a wrong gradient moves every step, rounding only the ill-conditioned ones.
GRAD_NORM_TOL = 3e-3
GRAD_NORM_MEDIAN_TOL = 2e-5
STEPS = 12
SWITCH_STEP = 3  # first low-rank step: round(0.25 * 12)
BASE = ["model=gpt_tiny", f"train.steps={STEPS}", "train.global_batch=8",
        "train.micro_batch=4", "train.eval_batches=1", "train.eval_every=100",
        "train.ckpt_every=100", "train.warmup_steps=1", "tracking=none",
        "data.max_bytes=400000",
        "lowrank=fixed", "lowrank.switch_frac=0.25", "lowrank.rank_ratio=0.25",
        "lowrank.keep_first_blocks=0", "lowrank.keep_last_blocks=0"]
LAYOUTS: Dict[str, List[str]] = {"fsdp": ["layout=fsdp", "layout.dp_shard=2"],
                                 "tp": ["layout=tp", "layout.tp=2"],
                                 "cp": ["layout.cp=2"]}


def losses(result: Dict) -> List[float]:
    return [h["loss"] for h in result["history"]]


def switch_step(result: Dict) -> int:
    steps = {int(h["lowrank/switch_step"]) for h in result["history"]
             if "lowrank/switch_step" in h}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowrank_parallel")
    cases = []
    for name, ov in LAYOUTS.items():
        cfg = compose(BASE + ov)
        layout = layouts.resolve(cfg.layout, cfg.train, 2)
        validate_layout(layout, cfg.model, 2)
        cases.append(Case(name, cfg, layout, ckpt_dir=""))
    data = load_data(cases[0].cfg.data)
    results = run_cases(2, cases, data, str(root / "ranks"), timeout_s=300)
    cfg = compose(BASE)
    ref = run_single(cfg, layouts.resolve(cfg.layout, cfg.train, 1), data, str(root / "single"))
    return {"results": {c.name: r for c, r in zip(cases, results)}, "ref": ref}


def test_reference_switches(runs):
    ref = runs["ref"]
    assert len(ref["history"]) == STEPS
    assert switch_step(ref) == SWITCH_STEP


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lowrank_losses_match_single_process(runs, name):
    result = runs["results"][name]
    assert "error" not in result, result.get("traceback")
    assert len(result["history"]) == STEPS
    assert switch_step(result) == SWITCH_STEP
    got, want = losses(result), losses(runs["ref"])
    errs = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    print(f"{name}: max relative loss error {max(errs):.3e}")
    assert max(errs) < REL_TOL, (got, want)
    norms = [h["grad_norm"] for h in result["history"]]
    ref_norms = [h["grad_norm"] for h in runs["ref"]["history"]]
    norm_errs = [abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)]
    assert max(norm_errs) < GRAD_NORM_TOL
    assert statistics.median(norm_errs) < GRAD_NORM_MEDIAN_TOL
    per_step = [h["comm/bytes_per_step"] for h in result["history"]]
    print(f"{name}: bytes/step before {per_step[SWITCH_STEP - 1]:.0f} after {per_step[-1]:.0f}")
    # the factorized model is smaller: fewer trainable parameters after the switch
    trainable = [h["params/trainable"] for h in result["history"]]
    assert trainable[-1] < trainable[0]
    assert trainable == [h["params/trainable"] for h in runs["ref"]["history"]]


def test_fsdp_moves_fewer_bytes_after_the_switch(runs):
    result = runs["results"]["fsdp"]
    assert "error" not in result, result.get("traceback")
    per_step = [h["comm/bytes_per_step"] for h in result["history"]]
    before, after = per_step[SWITCH_STEP - 1], per_step[-1]
    assert all(b == before for b in per_step[:SWITCH_STEP])
    assert after < before
    # all-gather and reduce-scatter both shrink: they move the (smaller) parameters
    for kind in ("allgather", "reduce_scatter"):
        key = f"comm/{kind}_bytes"
        assert result["history"][-1][key] < result["history"][SWITCH_STEP - 1][key], kind
