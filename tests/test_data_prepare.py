"""workbench.data.prepare on files the tests write, through the real `datasets` and `tokenizers`
packages, offline: trained and saved BPE tokenizers, JSONL / Parquet / text, document-level
validation, resume after SIGKILL (byte-identical), bounded memory, and one-line bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cli

from workbench.data.corpus import open_tokens
from workbench.data.prepare import prepare
from workbench.data.tokenizer import Tok
from workbench.errors import InputError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, 60 + i % 40)) for i in range(n)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _decode(folder: Path, split: str) -> str:
    from tokenizers import Tokenizer

    data = open_tokens(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = np.asarray((data.train if split == "train" else data.val).array()).tolist()
    return tok.decode(ids, skip_special_tokens=False)


def test_trained_bpe_then_saved_tokenizer_on_jsonl_and_parquet(tmp_path):
    docs = _docs(200)
    meta, out = prepare([str(_jsonl(tmp_path / "c.jsonl", docs)), str(tmp_path / "a"),
                         "--train-tokenizer", "300", "--workers", "2"])
    assert meta["vocab"] == 300 and meta["dtype"] == "uint16"
    assert meta["train_docs"] + meta["val_docs"] == 200 and meta["val_docs"] > 0
    assert (out / "tokenizer.json").exists() and len(meta["tokenizer"]["sha256"]) == 64
    text = _decode(out, "train") + _decode(out, "val")
    assert text.count("<|endoftext|>") == 200  # documents separated by the end-of-text token
    # validation holds whole documents: each val document appears intact, none in train
    val_docs = _decode(out, "val").split("<|endoftext|>")[:-1]
    assert val_docs and all(d in docs and d not in _decode(out, "train") for d in val_docs)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs[:120]}), tmp_path / "c.parquet")
    meta2, out2 = prepare([str(tmp_path / "c.parquet"), str(tmp_path / "b"), "--tokenizer",
                           str(out / "tokenizer.json"), "--text-field", "body"])
    assert meta2["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    assert meta2["train_docs"] + meta2["val_docs"] == 120
    (tmp_path / "c.txt").write_text("\n\n".join(docs[:30]))
    meta3, _ = prepare([str(tmp_path / "c.txt"), str(tmp_path / "t"), "--tokenizer",
                        str(out)])
    assert meta3["train_docs"] + meta3["val_docs"] == 30  # a paragraph is a document


def test_dtype_follows_vocabulary():
    assert Tok("x", 50257, 0, "h").dtype == "uint16"
    assert Tok("x", 128256, 0, "h").dtype == "uint32"


def _corpus(path: Path, n_files: int, size: int) -> Path:
    path.mkdir()
    rng = np.random.default_rng(1)
    for i in range(n_files):
        words = rng.choice(WORDS, size // 5)
        (path / f"f{i:04d}.txt").write_text(" ".join(words)[:size])
    return path


PREP = [sys.executable, "-m", "workbench.data.prepare"]


def test_resume_after_sigkill_is_byte_identical(tmp_path):
    src = _corpus(tmp_path / "src", 60, 40_000)
    args = [str(src), "--shard-mb", "0.1", "--workers", "1", "--train-tokenizer", "400"]
    ref_meta, ref = prepare(args[:1] + [str(tmp_path / "ref")] + args[1:])
    out = tmp_path / "out"
    proc = subprocess.Popen(PREP + args[:1] + [str(out)] + args[1:], env=os.environ.copy(),
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "train-00003.bin").exists() and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists()  # a reader sees no dataset until it is whole
    assert not (out / "train-00003.bin.json").exists() or (out / "train-00003.bin").exists()
    meta, _ = prepare(args[:1] + [str(out)] + args[1:])
    files = sorted(p.name for p in ref.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (ref / name).read_bytes() == (out / name).read_bytes(), name
    assert meta["fingerprint"] == ref_meta["fingerprint"] and len(meta["shards"]["train"]) > 4


@pytest.mark.slow
def test_memory_stays_bounded_on_a_corpus_larger_than_the_limit(tmp_path):
    """Resident memory is capped at 90 MB (a watchdog kills the prepare above it) while the
    corpus is 100 MB of text: streaming, not loading."""
    limit = 90 << 20
    src = _corpus(tmp_path / "src", 100, 1 << 20)
    proc = subprocess.Popen(PREP + [str(src), str(tmp_path / "out"), "--workers", "1",
                                    "--shard-mb", "4"], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import psutil

    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
        except psutil.Error:
            continue
        peak = max(peak, rss)
        if rss > limit:
            proc.kill()
            pytest.fail(f"prepare used {rss >> 20} MB resident, over the {limit >> 20} MB limit")
        time.sleep(0.05)
    assert proc.returncode == 0, proc.stderr
    assert 0 < peak < limit
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] > 100 * (1 << 20) * 0.99 > limit


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


BAD = [
    (lambda d: _jsonl(d / "x.jsonl", _docs(5), field="body"), [], "--text-field"),
    (lambda d: _write(d / "e.jsonl", b""), [], "is empty"),
    (lambda d: _write(d / "u" / "b.txt", b"\xff\xfe\x00bad").parent, [], "not UTF-8"),
    (lambda d: _jsonl(d / "ok.jsonl", _docs(5)), ["--tokenizer", "TOK"], "does not parse"),
    (lambda d: _write(d / "j.jsonl", b"{not json\n"), [], "cannot read"),
]


@pytest.mark.parametrize("make,extra,needle", BAD)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, make, extra, needle):
    src = make(tmp_path)
    (tmp_path / "tok.json").write_text('{"model": 42}')
    extra = [str(tmp_path / "tok.json") if a == "TOK" else a for a in extra]
    out = cli("workbench.data.prepare", [str(src), str(tmp_path / "out"), *extra], tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_hub_tokenizer_in_the_local_cache_works_offline(tmp_path, monkeypatch):
    """A tokenizer named by its hub id loads from the Hugging Face cache without the network (a
    cluster's compute nodes), the same bytes as the file given by path; one not cached, with the
    hub unreachable, is one line and exit 2 at once, not ~25 s of logged retries."""
    meta, out = prepare([str(_jsonl(tmp_path / "c.jsonl", _docs(80))), str(tmp_path / "a"),
                         "--train-tokenizer", "300"])
    repo, commit = tmp_path / "hub" / "models--acme--tok", "5f" * 20
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "tokenizer.json").write_bytes(
        (out / "tokenizer.json").read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # never resolves (RFC 6761)
    ok = cli("workbench.data.prepare", [str(tmp_path / "c.jsonl"), str(tmp_path / "b"),
                                        "--tokenizer", "acme/tok"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    got = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert got["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    bad = cli("workbench.data.prepare", [str(tmp_path / "c.jsonl"), str(tmp_path / "d"),
                                         "--tokenizer", "acme/missing"], tmp_path)
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert "not in the Hugging Face cache" in lines[0] and "hub.invalid" in lines[0]
    hub = cli("workbench.data.prepare", ["hf:acme/corpus", str(tmp_path / "e")], tmp_path)
    lines = [ln for ln in hub.stderr.splitlines() if ln.strip()]
    assert hub.returncode == 2 and len(lines) == 1 and "unreachable" in lines[0], hub.stderr


def test_in_process_errors_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="--val-frac"):
        prepare([str(tmp_path), str(tmp_path / "o"), "--val-frac", "0.9"])
