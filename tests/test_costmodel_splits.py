"""benchmarks/calibration/splits.csv and the development / held-out figures of
benchmarks/costmodel_accuracy.py: every scored source is declared, an undeclared one stops the
run (exit 2), and both splits are printed per source and overall."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import REPO, benchmark_module

from workbench.errors import ConfigError, InputError
from workbench.plan.accuracy.scores import SPLITS, by_split, figures, read_splits

CALIBRATION = REPO / "benchmarks" / "calibration"
MOSAIC = CALIBRATION / "mosaicml_layouts.csv"


@pytest.fixture(scope="module")
def accuracy():
    return benchmark_module("costmodel_accuracy")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_every_calibration_source_is_declared_and_only_mosaicml_is_held_out() -> None:
    splits = read_splits(CALIBRATION / "splits.csv")
    sources = {r["source_group"] for p in CALIBRATION.glob("*_layouts.csv") for r in _rows(p)}
    assert sources <= set(splits), sources - set(splits)
    assert {s for s, r in splits.items() if r["split"] == "held_out"} == {"mosaicml"}
    assert all(r["chose"].strip() and r["evidence"].strip() for r in splits.values())


def test_bad_splits_files_are_refused(tmp_path) -> None:
    good = {"source_group": "a", "split": "development", "chose": "x", "evidence": "y"}
    with pytest.raises(ConfigError, match="one of development, held_out"):
        read_splits(_write(tmp_path / "s.csv", [{**good, "split": "test"}]))
    with pytest.raises(ConfigError, match="named once"):
        read_splits(_write(tmp_path / "s.csv", [good, good]))
    with pytest.raises(InputError, match="missing columns evidence"):
        read_splits(_write(tmp_path / "s.csv", [{k: v for k, v in good.items()
                                                 if k != "evidence"}]))


def test_an_undeclared_source_exits_2_with_one_line(accuracy, tmp_path, capsys) -> None:
    rows = [{**r, "source_group": "brand_new"} for r in _rows(MOSAIC)[:2]]
    code = accuracy.main(["--csv", str(_write(tmp_path / "new_layouts.csv", rows))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "source_group='brand_new'" in err and "splits.csv" in err


def test_both_splits_printed_per_source_and_overall(accuracy, tmp_path, capsys) -> None:
    """Six priced rows, three of one sweep in each split: per source and overall lines for
    both, the held-out one with its figures."""
    mosaic = [r for r in _rows(MOSAIC) if r["model"] == "MPT-125m"
              and r["gpu_type"].startswith("A100")][:3]
    dev = [{**r, "source_group": "dev_src"} for r in mosaic]
    rows = _write(tmp_path / "rows_layouts.csv", mosaic + dev)
    splits = _write(tmp_path / "splits.csv", [
        {"source_group": "mosaicml", "split": "held_out", "chose": "none", "evidence": "t"},
        {"source_group": "dev_src", "split": "development", "chose": "c", "evidence": "t"}])
    code = accuracy.main(["--csv", str(rows), "--splits", str(splits),
                          "--memory-csv", str(tmp_path / "none.csv")])
    out = capsys.readouterr().out
    assert code == 0
    table = out.split("development and held-out figures", 1)[1].split("\n\n", 1)[0]
    lines = {tuple(line.split()[:3]) for line in table.splitlines()[2:]}
    assert {("dev_src", "development", "3"), ("mosaicml", "held_out", "3"),
            ("overall", "development", "3"), ("overall", "held_out", "3")} <= lines


def test_figures_of_a_split() -> None:
    """Median |error|, the sweep's Spearman and top-1 regret, false OOM alarms on rows that
    ran, and OOM F1 only where rows are labelled."""
    base = {"source_group": "s", "model": "m", "n_gpus": "8", "metric": "tokens_per_sec_per_gpu",
            "gpu_type": "g"}
    pairs = [(base, 100.0, 110.0), (base, 200.0, 190.0), (base, 300.0, 150.0)]
    preds = [{**base, "pred_fits": "false", "pred_headroom_gib": "-1"},
             {**base, "pred_fits": "true", "pred_headroom_gib": "3"},
             {**base, "pred_fits": "false", "pred_headroom_gib": "-2", "outcome": "oom"}]
    fig = figures(pairs, preds)
    assert fig.rows == 3 and fig.median_err_pct == pytest.approx(10.0)
    assert fig.sweeps == 1 and fig.median_rho == pytest.approx(0.5)
    assert fig.max_regret == pytest.approx(1 / 3)  # picks 200 where 300 was measured
    assert (fig.false_oom, fig.ran, fig.oom_labels, fig.oom_f1) == (1, 2, 1, pytest.approx(2 / 3))
    _, per_split = by_split(pairs, preds, {"s": {"split": "held_out"}})
    assert set(per_split) == set(SPLITS) and per_split["development"].rows == 0
