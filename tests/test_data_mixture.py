"""Mixtures of prepared corpora: batches a pure function of (seed, step), per-source counts that
match the weights, per-source validation, the checks on weights and tokenizers, model.vocab
following the data, the tokenizer hash on the run, and the mixture report's fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, cli, only_run
from readme_blocks import block_with, make_clone, run_block

from workbench.config import DataConfig
from workbench.data.corpus import resolve_vocab
from workbench.data.mixture import build_mixture
from workbench.data.prepare import prepare
from workbench.errors import ConfigError
from workbench.sweep.mixture import fit, write


def _source(tmp: Path, name: str, letter: str, extra=()) -> str:
    lines = "".join(json.dumps({"text": f"{letter} {i} " + letter * (50 + i % 30)}) + "\n"
                    for i in range(80))
    (tmp / f"{name}.jsonl").write_text(lines)
    prepare([str(tmp / f"{name}.jsonl"), str(tmp / name), "--workers", "1", *extra])
    return str(tmp / name)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    return tmp, {"a": _source(tmp, "a", "x"), "b": _source(tmp, "b", "y")}


def test_batches_are_bitwise_reproducible_and_follow_the_weights(two):
    tmp, sources = two
    cfg = DataConfig(sources=sources, weights={"a": 1.0, "b": 3.0}, cache_dir=str(tmp))
    mix, again = build_mixture(cfg), build_mixture(cfg)
    seq, n, steps = 16, 16, 300
    counts = np.zeros(2)
    for step in range(steps):
        rows = mix.offsets(7, "train", step, n, seq)
        assert np.array_equal(rows, again.offsets(7, "train", step, n, seq))
        x, y = mix.gather("train", rows, seq)
        x2, y2 = again.gather("train", again.offsets(7, "train", step, n, seq), seq)
        assert np.array_equal(x, x2) and np.array_equal(y, y2)
        # each row comes from the source it names: bytes of 'x' for a, of 'y' for b
        assert all((ord("x") in xr) == (k == 0) for xr, k in zip(x, rows[:, 0]))
        counts += np.bincount(rows[:, 0], minlength=2)
    frac, total = counts[1] / counts.sum(), steps * n
    assert abs(frac - 0.75) < 4 * np.sqrt(0.75 * 0.25 / total)  # within sampling error
    assert not np.array_equal(mix.offsets(7, "train", 0, n, seq), mix.offsets(8, "train", 0, n,
                                                                               seq))
    vals = mix.val_losses(lambda split: {"val:0": 2.0, "val:1": 4.0}[split])
    assert vals == {"val_loss/a": 2.0, "val_loss/b": 4.0, "val_loss": 3.5}
    target = build_mixture(DataConfig(sources=sources, target={"a": 1.0}, cache_dir=str(tmp)))
    assert target.val_losses(lambda s: {"val:0": 2.0, "val:1": 4.0}[s])["val_loss"] == 2.0


def test_bad_weights_and_mixed_tokenizers_are_config_errors(two):
    tmp, sources = two
    with pytest.raises(ConfigError, match="data.weights"):
        build_mixture(DataConfig(sources=sources, weights={"a": 0.0, "b": 0.0}))
    bpe = _source(tmp, "c", "z", ["--train-tokenizer", "270"])
    with pytest.raises(ConfigError, match="one tokenizer"):
        build_mixture(DataConfig(sources={"a": sources["a"], "c": bpe}, cache_dir=str(tmp)))
    out = cli("workbench.run", ["+data.sources.a=" + sources["a"], "+data.weights.a=-1"], tmp)
    assert out.returncode == 2 and "data.weights.a" in out.stderr


def test_model_vocab_follows_the_data_unless_set():
    class D:
        vocab, tokenizer = 2048, "bpe"

    assert resolve_vocab(256, D(), []) == 2048
    assert resolve_vocab(4096, D(), ["model.vocab=4096"]) == 4096
    with pytest.raises(ConfigError, match=r"model.vocab=256.*2048"):
        resolve_vocab(256, D(), ["model.vocab=256"])


def test_run_on_bpe_shards_sets_vocab_and_logs_tokenizer_hash(workdir):
    lines = "".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 40}) + "\n"
                    for i in range(60))
    (workdir / "c.jsonl").write_text(lines)
    meta, out = prepare([str(workdir / "c.jsonl"), str(workdir / "shards"),
                         "--train-tokenizer", "300"])
    run = cli("workbench.run", FAST + ["data=tokens", f"data.path={out}"], workdir)
    assert run.returncode == 0, run.stderr
    r = only_run()
    assert r.data.tags["wb.tokenizer_hash"] == meta["tokenizer"]["sha256"][:16]
    assert r.data.params["model.vocab"] == "300"
    manifest = json.loads(Path(r.data.tags["wb.run_dir"], "manifest.json").read_text())
    assert manifest["tokenizer_hash"] == meta["tokenizer"]["sha256"]
    bad = cli("workbench.run", FAST + ["data=tokens", f"data.path={out}", "model.vocab=256"],
              workdir)
    assert bad.returncode == 2 and "256" in bad.stderr and "300" in bad.stderr


def test_mixture_report_fits_weights_to_loss(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(3), size=12)
    loss = 3.0 * w[:, 0] + 2.0 * w[:, 1] + 2.5 * w[:, 2]
    result = fit(w, loss, ["a", "b", "c"])
    assert result["r2"] > 0.999 and result["best_weights"]["b"] == 1.0
    rows = [{"trial": i, "weights": dict(zip("abc", wi)), "val_loss": li,
             **{f"val_loss/{n}": li for n in "abc"}} for i, (wi, li) in enumerate(zip(w, loss))]
    out = write(["a", "b", "c"], rows, tmp_path / "r")
    assert (tmp_path / "r" / "fit.png").stat().st_size > 0 and "Best predicted" in out["markdown"]


@pytest.mark.slow
def test_data_mixture_sweep_attaches_the_report_to_the_parent(workdir, monkeypatch):
    """The README's recipe block, reduced (3 trials of 10 steps on 300 kB per source), end to
    end."""
    import mlflow

    clone = make_clone(workdir)
    block = block_with("python -m workbench.run +sweep=data_mixture")
    out = run_block(block, clone, ["sweep.n_trials=3", "train.steps=10", "train.eval_every=5",
                                   "train.global_batch=8", "train.micro_batch=8",
                                   "data.max_bytes=300000"])
    assert out.returncode == 0, f"README {block.id} failed:\n{out.stderr[-4000:]}"
    assert "Best predicted mixture" in out.stdout
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{clone / 'mlflow.db'}")
    c = mlflow.MlflowClient()
    runs = c.search_runs([c.get_experiment_by_name("workbench").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and len(runs) == 4
    files = {a.path for a in c.list_artifacts(parents[0].info.run_id, "report")}
    assert {"report/report.md", "report/report.json", "report/fit.png"} <= files
    children = [r for r in runs if r is not parents[0]]
    assert all({"val_loss/tests", "val_loss/modules", "val_loss/docs"} <= set(r.data.metrics)
               for r in children)
