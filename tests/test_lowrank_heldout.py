"""The adaptive switch on settings that chose none of the detector's: the documented block of
docs/lowrank.md (`benchmarks/lowrank_heldout.py`: a GPT-2-style model of a shape no setting was
chosen on, seeds 11, 12, 13, warm-up 10%, the shipped defaults) run as written, once for the
module.

Its runs are long enough for the detector to decide (the cap, max_switch_frac 0.5, forces
nothing unless the ranks keep moving past half of training), so each check can fail: every
switch comes from the detector; the two check intervals (0.5% and 2% of training) switch within
2% of training of each other in every seed; adaptive's final val_loss is on average at most 1%
above full rank's at the same steps and data. The bounds were written before the first held-out
run, and two of the three checks failed on it (seed 13's check intervals 4.5% of training apart,
a mean gap of +1.64%): those two are strict expected failures, the record of a claim the
detector does not meet on held-out settings. Should they start to pass, the XPASS fails this
module: the record (docs/lowrank.md, Held-out seeds and model) is then out of date."""

from __future__ import annotations

import json
import statistics

import pytest
from readme_blocks import block_with, make_clone, run_block

pytestmark = pytest.mark.slow

MEASURED = "measured on the held-out seeds (docs/lowrank.md, Held-out seeds and model)"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, cache_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_CACHE", str(cache_dir))
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        clone = make_clone(tmp_path_factory.mktemp("lowrank_heldout"))
        block = block_with("python benchmarks/lowrank_heldout.py")
        proc = run_block(block, clone)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    path = clone / "heldout.json"
    assert path.exists(), out
    result = json.loads(path.read_text())
    # the exit status is the verdict: 0 when every check passed, 1 when one failed
    assert proc.returncode == (0 if all(result["verdicts"].values()) else 1), out
    assert all(("PASS" if ok else "FAIL") + f"  {what}" in proc.stdout
               for what, ok in result["verdicts"].items()), out
    return result["rows"], out


def test_three_seeds_every_switch_by_the_detector_and_factorized(heldout):
    rows, out = heldout
    assert len(rows) >= 3, out
    assert not any(any(r["forced"]) for r in rows), out
    assert all(r["params"] < r["params_off"] for r in rows), out  # it did factorize


@pytest.mark.xfail(strict=True, reason=f"seed 13: 33.5% vs 38.0% of training, {MEASURED}")
def test_check_intervals_agree_within_2pct_in_every_seed(heldout):
    rows, out = heldout
    assert all(r["agree_pct"] <= 2.0 for r in rows), out


@pytest.mark.xfail(strict=True, reason=f"mean gap +1.64% (sd 0.35) over 3 seeds, {MEASURED}")
def test_mean_val_loss_gap_to_full_rank_at_most_1pct(heldout):
    rows, out = heldout
    assert statistics.mean(r["gap_pct"] for r in rows) <= 1.0, out
