"""benchmarks/costmodel_accuracy.py `twin_agreement`: how well a published sweep agrees with
itself, read from the same layouts measured with another attention kernel.

The Spearman target of a sweep means something only where the measurements rank their layouts
reproducibly; these tests pin the diagnostic and the two readings the closing notes rest on:
hagemann2023's 13B/64-GPU sheet does not repeat its own order across kernels of equal speed,
its 30B/256-GPU sheet does (so the model's low rank correlation there is the model's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, benchmark_module

HAGEMANN = REPO / "benchmarks" / "calibration" / "hagemann2023_layouts.csv"


def _module():
    return benchmark_module("costmodel_accuracy")


def _pair(tag: str, tp: int, pp: int, seconds: float) -> tuple[dict[str, str], float, float]:
    row = {"source_group": "s", "model": f"M [{tag}]", "n_gpus": "64", "tp": str(tp),
           "pp": str(pp), "micro_batch": "1", "metric": "seconds_per_iter"}
    return row, seconds, seconds


def test_twins_that_rank_alike_agree_and_reversed_twins_disagree() -> None:
    mod = _module()
    layouts = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    same = [_pair("a", tp, pp, 10.0 + i) for i, (tp, pp) in enumerate(layouts)]
    same += [_pair("b", tp, pp, 20.0 + 2 * i) for i, (tp, pp) in enumerate(layouts)]
    got = mod.twin_agreement(same)
    assert got[("s", "M [a] n=64")] == pytest.approx((1.0, "b", 6))
    assert got[("s", "M [b] n=64")][1] == "a"
    flipped = [p for p in same if "[a]" in p[0]["model"]]
    flipped += [_pair("b", tp, pp, 30.0 - i) for i, (tp, pp) in enumerate(layouts)]
    assert mod.twin_agreement(flipped)[("s", "M [a] n=64")][0] == pytest.approx(-1.0)


def test_the_twin_sharing_most_layouts_is_read_and_small_overlaps_are_not() -> None:
    """Of two twins the one with more common layouts sets the figure; fewer than SWEEP_MIN
    common layouts make no twin."""
    mod = _module()
    layouts = [(t, p) for t in (1, 2, 4) for p in (1, 2, 4)]
    pairs = [_pair("a", tp, pp, 1.0 + i) for i, (tp, pp) in enumerate(layouts)]
    pairs += [_pair("wide", tp, pp, 9.0 - i) for i, (tp, pp) in enumerate(layouts)]
    pairs += [_pair("narrow", tp, pp, 1.0 + i) for i, (tp, pp) in enumerate(layouts[:5])]
    pairs += [_pair("tiny", tp, pp, 1.0 + i) for i, (tp, pp) in enumerate(layouts[:4])]
    got = mod.twin_agreement(pairs)
    assert got[("s", "M [a] n=64")][1:] == ("wide", 9)
    assert ("s", "M [tiny] n=64") not in got


def test_hagemann_13b_sheet_does_not_repeat_its_order_and_the_30b_sheet_does() -> None:
    mod = _module()
    from workbench.plan.accuracy.predict import read_rows

    pairs = mod.measured_vs_predicted(read_rows(HAGEMANN)[1])
    twins = mod.twin_agreement(pairs)
    rho13, tag13, n13 = twins[("hagemann2023", "Llama-13B s2k [flash2] n=64")]
    assert (tag13, n13) == ("flash1", 18) and rho13 < 0.7
    for kernel in ("flash1", "flash2"):
        rho30, _, n30 = twins[("hagemann2023", f"Llama-30B s2k [{kernel}] n=256")]
        assert n30 == 28 and rho30 > 0.95


def test_the_readme_fabric_what_if_rescores_one_source(tmp_path: Path) -> None:
    """The README's `--interconnect hagemann2023=...` block scores that source's rows on another
    fabric and leaves the others alone: one 200 Gb/s link per node, the what-if of the closing
    notes, brings the 30B/256-GPU sweep's ranking from ~0.6 to ~0.85 and its source's median
    under 8%, while hagemann2023_sp and the shared rows keep their figures."""
    from readme_blocks import block_with, make_clone, run_block

    needle = "python benchmarks/costmodel_accuracy.py --interconnect"
    proc = run_block(block_with(needle), make_clone(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = {line.split()[0]: float(line.split()[3]) for line in proc.stdout.splitlines()
             if line.startswith(("hagemann2023", "sc21_t1"))}
    assert table["hagemann2023"] < 8.0 and table["hagemann2023_sp"] == pytest.approx(10.3, abs=0.05)
    assert table["sc21_t1"] == pytest.approx(2.5, abs=0.05)
    rho = [line for line in proc.stdout.splitlines()
           if "Llama-30B s2k [flash2] n=256  layouts" in line]
    assert len(rho) == 1 and float(rho[0].split("rho=")[1].split()[0]) > 0.85


def test_a_what_if_without_text_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _module()
    assert mod.main(["--interconnect", "hagemann2023"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--interconnect 'hagemann2023'" in err[0] and "SOURCE=TEXT" in err[0]


def test_kernel_ratios_are_medians_oriented_slow_over_fast() -> None:
    """Per layout the time ratio of two kernels' twins; the median over their common layouts,
    oriented so the measured figure is >= 1, and the model's ratio in the same orientation."""
    mod = _module()
    layouts = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]
    pairs = []
    for i, (tp, pp) in enumerate(layouts):
        fast, slow = _pair("a", tp, pp, 10.0 + i), _pair("b", tp, pp, 12.0 + 1.2 * i)
        pairs += [fast, (slow[0], slow[1], slow[2] * 0.9)]  # the model: b is 1.08x a
    (src, sweep, tags, n, meas, pred), = mod.kernel_ratios(pairs)
    assert (src, sweep, tags, n) == ("s", "M n=64", "b / a", 5)
    assert meas == pytest.approx(1.2) and pred == pytest.approx(1.08)


def test_hagemann_kernel_ratios_are_priced_within_8_percent() -> None:
    """The reading the closing notes rest on: every kernel choice of the hagemann2023 sheets
    (FlashAttention 1 vs 2, the RMS kernel, the fused softmax, the eager torch attention with its
    fp32 softmax counted op by op) costs within 8% of the time ratio the sheets measure; the
    eager core at 8k, 1.95x FlashAttention 2's step time, was priced 1.33x with the fused
    kernel's bytes."""
    mod = _module()
    from workbench.plan.accuracy.predict import read_rows

    got = {(sweep, tags): (meas, pred) for _, sweep, tags, _, meas, pred
           in mod.kernel_ratios(mod.measured_vs_predicted(read_rows(HAGEMANN)[1]))}
    assert len(got) == 19
    for key, (meas, pred) in got.items():
        assert abs(pred / meas - 1) < 0.08, key
    meas, pred = got[("Llama-13B s8k n=128", "torch attention / flash2")]
    assert meas == pytest.approx(1.95, abs=0.01) and pred > 1.9


def test_hagemann_sp_twins_are_priced_within_3_percent() -> None:
    """The same layouts with sequence parallelism on and off (hagemann2023_sp): the model's
    time ratio is within 3% of the measured one in every sheet with >= 5 such pairs; before a
    sequence-parallel stage sent its shard, the 65B sheet's x1.08 was priced x1.05."""
    mod = _module()
    from workbench.plan.accuracy.predict import read_rows

    sp_csv = HAGEMANN.with_name("hagemann2023_sp_layouts.csv")
    got = mod.kernel_ratios(mod.measured_vs_predicted(read_rows(sp_csv)[1]), by="cp_or_sp")
    assert len(got) == 4 and {tags for _, _, tags, _, _, _ in got} == {"none / SP"}
    for _, sweep, _, _, meas, pred in got:
        assert abs(pred / meas - 1) < 0.03, sweep


def test_hagemann_recompute_twins_are_priced_within_8_percent() -> None:
    """Full recompute against none on the same layouts: the model's x1.31-1.33 against the
    sheets' x1.26-1.42 (the 65B sheet's x1.42 the farthest)."""
    mod = _module()
    from workbench.plan.accuracy.predict import read_rows

    got = mod.kernel_ratios(mod.measured_vs_predicted(read_rows(HAGEMANN)[1]), by="recompute")
    assert len(got) == 5 and {tags for _, _, tags, _, _, _ in got} == {"full / none"}
    for _, sweep, _, _, meas, pred in got:
        assert abs(pred / meas - 1) < 0.08, sweep
