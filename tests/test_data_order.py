"""data.order=epochs: every non-overlapping window of a corpus once per epoch, in a seeded order
that is a pure function of (seed, global sequence index), for one corpus and for a mixture;
data=tokens runs that way, and `random` stays what the recorded runs used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli, metric_series

from workbench.config import DataConfig
from workbench.data.mixture import build_mixture
from workbench.data.order import epoch_keys, epoch_starts, permute
from workbench.data.prepare import prepare
from workbench.data.tokens import batch_offsets, open_corpus


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 1000, 65_537])
def test_the_epoch_order_is_a_permutation(n: int) -> None:
    keys = epoch_keys(3, 0, 0)
    p = permute(np.arange(n), n, keys)
    assert sorted(p.tolist()) == list(range(n))
    if n >= 8:  # another epoch (or seed) is another order, not the identity
        assert not np.array_equal(p, permute(np.arange(n), n, epoch_keys(3, 0, 1)))
        assert not np.array_equal(p, np.arange(n))


def test_a_huge_corpus_needs_no_shuffle_table() -> None:
    """10^12 tokens at 8,192 a window: 122M windows; a step's 4,096 indices are permuted on their
    own (no table) and land inside the corpus, all distinct."""
    windows = 10**12 // 8192
    p = permute(np.arange(5 * 10**7, 5 * 10**7 + 4096), windows, epoch_keys(1, 0, 0))
    assert p.min() >= 0 and p.max() < windows and len(set(p.tolist())) == 4096


def test_one_epoch_reads_every_window_once_and_random_does_not() -> None:
    """Over one epoch's worth of steps `epochs` covers the corpus exactly once (bar the tail
    shorter than a window); `random` reads about 1 - 1/e of it, some text several times."""
    n_tokens, seq, batch = 20_001, 16, 25  # 1,250 windows: 50 steps of 25 sequences
    windows = (n_tokens - 1) // seq
    starts = np.concatenate([batch_offsets(5, "train", s, batch, n_tokens, seq, "epochs")
                             for s in range(windows // batch)])
    assert sorted(starts.tolist()) == [w * seq for w in range(windows)]
    # the same sequences asked another way (a later first index, another count) agree
    assert np.array_equal(epoch_starts(5, 0, 100, 50, n_tokens, seq), starts[100:150])
    nxt = np.concatenate([batch_offsets(5, "train", s, batch, n_tokens, seq, "epochs")
                          for s in range(windows // batch, 2 * windows // batch)])
    assert sorted(nxt.tolist()) == sorted(starts.tolist()) and not np.array_equal(nxt, starts)
    seen = np.zeros(n_tokens, dtype=int)
    for s in range(windows // batch):
        for o in batch_offsets(5, "train", s, batch, n_tokens, seq, "random"):
            seen[o:o + seq + 1] += 1
    assert 0.55 < (seen > 0).mean() < 0.72 and seen.max() >= 3


def _corpus(tmp: Path, name: str, letter: str) -> str:
    lines = "".join(json.dumps({"text": f"{letter} {i} " + letter * (40 + i % 25)}) + "\n"
                    for i in range(120))
    (tmp / f"{name}.jsonl").write_text(lines)
    prepare([str(tmp / f"{name}.jsonl"), str(tmp / name), "--workers", "1"])
    return str(tmp / name)


def test_a_prepared_corpus_and_a_mixture_under_epochs(tmp_path) -> None:
    seq = 16
    data = open_corpus(Path(_corpus(tmp_path, "a", "x")))
    windows = (data.train.n_tokens - 1) // seq
    rows = np.concatenate([data.offsets(9, "train", s, 8, seq, "epochs") for s in
                           range(windows // 8)])
    assert set(rows[:, 0].tolist()) == {0} and len(set(rows[:, 1].tolist())) == len(rows)
    val = data.offsets(9, "val", 0, 32, seq, "epochs")[:, 1]
    assert len(set(val.tolist())) == min(32, (data.val.n_tokens - 1) // seq)
    mix = build_mixture(DataConfig(sources={"a": str(tmp_path / "a"),
                                            "b": _corpus(tmp_path, "b", "y")},
                                   weights={"a": 1.0, "b": 1.0}, cache_dir=str(tmp_path)))
    per = {0: [], 1: []}
    w = min((s.train.n_tokens - 1) // seq for s in mix.sources)
    for step in range(w // 8):
        r = mix.offsets(9, "train", step, 8, seq, "epochs")
        assert np.array_equal(r, mix.offsets(9, "train", step, 8, seq, "epochs"))
        for k, o in r:
            per[int(k)].append(int(o))
    # within as many global sequences as a source has windows, none of its windows repeats
    assert all(len(v) == len(set(v)) and all(o % seq == 0 for o in v) for v in per.values())
    assert len(per[0]) > 0 and len(per[1]) > 0


def test_a_tokens_run_reads_by_epochs(workdir) -> None:
    src = workdir / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"line {i}: " + "abc def " * (5 + i % 9)}) + "\n"
                           for i in range(300)))
    assert cli("workbench.data.prepare", [str(src), str(workdir / "s")], workdir).returncode == 0
    base = ["data=tokens", f"data.path={workdir / 's'}", "train.steps=4", "train.eval_every=4",
            "train.warmup_steps=1", "train.global_batch=4", "train.eval_batches=1"]
    losses = []
    for extra in (["train.run_dir=r1"], ["train.run_dir=r2", "data.order=random"]):
        out = cli("workbench.run", base + extra, workdir)
        assert out.returncode == 0, out.stderr[-2000:]
        job = json.loads((workdir / extra[0].split("=")[1] / "job.json").read_text())
        losses.append(metric_series(job["run_id"], "loss"))
    assert losses[0] != losses[1]  # the option reaches the loop (its batches are pure
    # functions of (seed, step): test_one_epoch_reads_every_window_once_and_random_does_not)
    job = json.loads((workdir / "r1" / "job.json").read_text())
    assert job["config"]["data"]["order"] == "epochs"
    # `epochs` counts passes over the training text: 4 steps of 4 x seq_len tokens
    train_tokens = open_corpus(workdir / "s").train_tokens
    seq = job["config"]["model"]["seq_len"]
    assert metric_series(job["run_id"], "epochs") == [
        (s, pytest.approx((s + 1) * 4 * seq / train_tokens)) for s in range(4)]
