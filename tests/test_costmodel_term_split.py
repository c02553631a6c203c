"""benchmarks/term_split.py: where a source's misses sit among the model's own time terms.

Checked on the hagemann2023 FlashAttention rows, where the split is the README's diagnosis:
compute and TP as modelled, the in-step data-parallel sync several times slower (inter-node).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO, benchmark_module

HAGEMANN = REPO / "benchmarks" / "calibration" / "hagemann2023_layouts.csv"


def _module():
    return benchmark_module("term_split")


def test_exact_terms_give_their_own_factors() -> None:
    """Measured times built as 1x compute + 3x dp come back as those factors, error 0."""
    mod = _module()
    rng = np.random.default_rng(0)
    terms = rng.uniform(0.1, 2.0, size=(40, len(mod.GROUPS)))
    truth = np.array([1.0, 1.0, 1.0, 1.0, 3.0])
    f, before, after = mod.factors(terms, terms @ truth)
    assert list(f.values()) == pytest.approx(truth.tolist())
    assert after == pytest.approx(0.0, abs=1e-9) and before > 10


def test_hagemann_misses_sit_in_the_data_parallel_sync() -> None:
    mod = _module()
    from workbench.plan.accuracy.predict import read_rows

    rows = [r for r in read_rows(HAGEMANN)[1]
            if "torch attention" not in r["model"] and "fused softmax" not in r["model"]]
    terms, meas, _ = mod.term_table(rows)
    f, before, after = mod.factors(terms, meas)
    assert len(meas) == 257 and before > 10 and after < 5
    assert 0.95 < f["compute"] < 1.2 and 0.7 < f["tp"] < 1.5
    assert f["dp"] > 4


def test_a_source_without_rows_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _module()
    assert mod.main(["--csv", str(HAGEMANN), "--source", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--source nope" in err[0]


def test_the_documented_command_prints_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    """The command of the module docstring (and the README's diagnosis)."""
    mod = _module()
    assert mod.main(["--csv", str(HAGEMANN), "--source", "hagemann2023",
                     "--exclude", "torch attention", "--exclude", "fused softmax"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("all") and " 257 rows" in out[0] and "dp x" in out[0]
    assert any(line.startswith("32 nodes") for line in out)


def test_a_missing_csv_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    from workbench.cli import guarded

    with pytest.raises(SystemExit) as e:
        guarded(_module().main)(["--csv", "/nonexistent.csv", "--source", "hagemann2023"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--csv" in err[0]


def test_the_split_by_tp_keeps_the_data_parallel_excess(capsys: pytest.CaptureFixture[str]) -> None:
    """--by tp: the in-step DP sync is x4+ at TP 1, 2 and 4 alike, so the excess is not the
    model's per-TP rail share (8 / TP NICs per data-parallel group on a node) gone wrong."""
    mod = _module()
    assert mod.main(["--csv", str(HAGEMANN), "--source", "hagemann2023", "--by", "tp",
                     "--exclude", "torch attention", "--exclude", "fused softmax"]) == 0
    lines = {line.split(" rows")[0].rsplit(" ", 1)[0].strip(): line
             for line in capsys.readouterr().out.splitlines()}
    for tp in ("tp 1", "tp 2", "tp 4"):
        assert float(lines[tp].split("dp x")[1].split()[0]) > 4, lines[tp]
