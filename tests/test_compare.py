"""Whether a difference is more than seed noise: paired t intervals over seeds, and the report's
"Across seeds" table over real runs (a learning rate 30x too small is worse beyond the noise)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FAST
from readme_blocks import block_with, make_clone, run_block

from workbench.compare import labels, paired_interval, verdict
from workbench.report import main as report


def test_paired_interval_is_students_t_and_the_verdict_reads_it():
    iv = paired_interval([0.1, 0.2, 0.3])  # mean 0.2, sd 0.1, t(2) = 4.303
    assert (iv.mean, iv.n) == (pytest.approx(0.2), 3)
    assert iv.high - iv.mean == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert verdict(iv, "lower", "higher") == "within seed noise"  # the interval holds 0
    assert verdict(paired_interval([0.21, 0.2, 0.19]), "lower", "higher") == "higher"
    assert verdict(paired_interval([-0.5, -0.45, -0.4]), "lower", "higher") == "lower"
    assert verdict(paired_interval([-0.5, -0.4]), "lower", "higher") == "within seed noise"
    assert verdict(paired_interval([0.0, 0.0, 0.0]), "lower", "higher") == "within seed noise"
    assert paired_interval([0.3]) is None and verdict(None, "a", "b") == "needs 2 shared seeds"
    big = paired_interval([float(i % 3) for i in range(40)])  # past the table: t(30), wider
    assert big.high - big.mean > 1.96 * 0.8165 / math.sqrt(40)


def test_labels_name_what_differs_and_groups_ignore_the_seed():
    params = [{"lowrank.mode": "off", "train.seed": s, "train.lr": lr, "train.run_dir": d}
              for d, (s, lr) in enumerate([(1, 1), (2, 1), (1, 2), (2, 2)])]
    tags = [{}] * 4
    assert labels(params, tags) == ["off seed=1 lr=1", "off seed=2 lr=1", "off seed=1 lr=2",
                                    "off seed=2 lr=2"]
    assert labels(params, tags, ignore=("train.seed",), unique=False) == [
        "off lr=1", "off lr=1", "off lr=2", "off lr=2"]


README_GRID = "python -m workbench.run --multirun train.seed=1,2,3"


def test_the_readme_grid_tells_a_real_difference_from_seed_noise(workdir):
    """The README's block (test_readme leaves it to this test): three seeds of the default
    learning rate and of one 30x smaller, at 12 steps, then the report over the experiment."""
    clone = make_clone(workdir)
    block = block_with(README_GRID)
    proc = run_block(block, clone, [o for o in FAST if not o.startswith("data.")])
    assert proc.returncode == 0, f"README {block.id} failed:\n{proc.stderr[-4000:]}"
    out = clone / "reports/lr_seeds"
    rows = {r["group"]: r for r in json.loads((out / "seeds.json").read_text())}
    assert set(rows) == {"off lr=0.003", "off lr=0.0001"}, rows
    slow = rows["off lr=0.0001"]
    assert slow["seeds"] == "1 2 3" and slow["val_loss_verdict"] == "higher val_loss", slow
    assert slow["val_loss_gap"] > 0 and slow["val_loss_gap_95ci"].startswith("[")
    assert "val_loss_gap" not in rows["off lr=0.003"]  # the baseline's group
    assert len(json.loads((out / "summary.json").read_text())) == 6
    md = (out / "report.md").read_text()
    assert "## Across seeds" in md and "higher val_loss" in md
    assert "Across seeds" in (out / "report.html").read_text()


def test_an_unknown_experiment_is_one_line_and_exit_2(workdir, capsys):
    from workbench.track.store import client

    client(f"sqlite:///{workdir / 'mlflow.db'}")  # a store, without that experiment
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        report(["experiment:nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "experiment:nope" in err[0]
