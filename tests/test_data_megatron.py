"""A Megatron-LM indexed dataset imported as shards: the same documents as tokenizing the text
here, whatever way Megatron cut them (several sequences per document, --append-eod or not,
empty documents), trainable at once; a wrong tokenizer or a damaged index is one line and exit 2.

The dataset is written by `write_indexed` below from the format as Megatron-LM's
`megatron/core/datasets/indexed_dataset.py` (_IndexWriter.write) lays it out: a 9-byte magic,
version u64 = 1, dtype code u8, sequence count u64, document-boundary count u64 (one more than
the documents: the boundaries start at 0), int32 lengths, int64 byte offsets, int64 boundaries.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import List

import numpy as np
import pytest
from conftest import cli

from workbench.data import tokenizer as toks
from workbench.data.corpus import open_tokens
from workbench.data.prepare import main as prepare

CODES = {np.uint8: 1, np.int32: 4, np.uint16: 8}


def write_indexed(prefix: Path, docs: List[List[List[int]]], dtype=np.uint16) -> None:
    """Documents as lists of sequences of ids, in Megatron's .bin/.idx layout."""
    lengths, bounds, blob = [], [0], bytearray()
    for doc in docs:
        for seq in doc:
            lengths.append(len(seq))
            blob += np.asarray(seq, dtype).tobytes()
        bounds.append(len(lengths))
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * item
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, CODES[dtype], len(lengths), len(bounds))
    idx += np.asarray(lengths, np.int32).tobytes() + pointers.tobytes()
    idx += np.asarray(bounds, np.int64).tobytes()
    Path(f"{prefix}.bin").write_bytes(bytes(blob))
    Path(f"{prefix}.idx").write_bytes(idx)


TEXTS = [f"Record {i}: the scheduler kept {i % 5} jobs and {i * 7 % 11} nodes idle. " * (3 + i % 4)
         for i in range(120)]


def _documents(folder: Path) -> List[tuple]:
    """Every document of a shard folder (both splits), as id tuples, sorted."""
    meta = json.loads((folder / "meta.json").read_text())
    eot, dtype = meta["tokenizer"]["eot_id"], meta["dtype"]
    out = []
    for split in ("train", "val"):
        for shard in meta["shards"][split]:
            ids = np.fromfile(folder / shard["file"], dtype).tolist()
            doc: list = []
            for t in ids:
                doc.append(t)
                if t == eot:
                    out.append(tuple(doc))
                    doc = []
    return sorted(out)


@pytest.fixture(scope="module")
def made(tmp_path_factory, cache_dir) -> Path:
    """The texts as JSONL, tokenized here with a trained BPE, and as a Megatron dataset made
    with the same tokenizer: half the documents cut into two sequences, a third ending in the
    end-of-text id (--append-eod), one empty. Built once; each test works on a copy."""
    root = tmp_path_factory.mktemp("megatron")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("WORKBENCH_CACHE", str(cache_dir))
        with open("corpus.jsonl", "w") as f:
            for t in TEXTS:
                f.write(json.dumps({"text": t}) + "\n")
        assert prepare(["corpus.jsonl", "text_shards", "--train-tokenizer", "400"]) == 0
    tok = toks.load(str(root / "text_shards/tokenizer.json"))
    enc = toks.Encoder(tok)
    docs: List[List[List[int]]] = []
    for i, text in enumerate(TEXTS):
        ids = enc.encode([text]).tolist()[:-1]  # without the end-of-text id
        if i % 3 == 0:
            ids.append(tok.eot_id)
        docs.append([ids[:len(ids) // 2], ids[len(ids) // 2:]] if i % 2 else [ids])
    docs.insert(7, [[]])
    write_indexed(root / "mega_text_document", docs)
    return root


@pytest.fixture
def corpus(made, workdir) -> Path:
    shutil.copytree(made / "text_shards", workdir / "text_shards")
    for suffix in (".bin", ".idx"):
        shutil.copy(made / f"mega_text_document{suffix}", workdir)
    return workdir


def test_the_import_holds_the_documents_tokenizing_the_text_does_and_trains(corpus):
    args = ["megatron:mega_text_document", "mega_shards", "--tokenizer",
            "text_shards/tokenizer.json", "--shard-mb", "0.004"]
    assert prepare(args) == 0
    assert _documents(corpus / "mega_shards") == _documents(corpus / "text_shards")
    meta = json.loads((corpus / "mega_shards/meta.json").read_text())
    assert meta["source"]["kind"] == "megatron" and meta["source"]["documents"] == 121
    assert len(meta["shards"]["train"]) > 3 and meta["val_docs"] > 0
    # a killed import keeps its finished shards and ends as an uninterrupted one does
    (corpus / "mega_shards/meta.json").unlink()
    (corpus / "mega_shards" / meta["shards"]["train"][1]["file"]).unlink()
    assert prepare(args) == 0
    assert json.loads((corpus / "mega_shards/meta.json").read_text()) == meta
    data = open_tokens(corpus / "mega_shards")
    assert data.train_tokens == meta["train_tokens"]
    run = cli("workbench.run", ["data=tokens", "data.path=mega_shards", "train.steps=2",
                                "train.eval_every=1", "train.eval_batches=1",
                                "train.global_batch=4", "tracking=none"], corpus)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("damage, needle", [
    ("tokenizer", "not the tokenizer that made it"),
    ("magic", "not a Megatron index"),
    ("truncate", "truncated"),
    ("pointers", "does not describe"),
    ("missing", "does not exist"),
    ("train", "already tokenized"),
])
def test_a_bad_import_is_one_line_and_exit_2(corpus, damage, needle, capsys):
    prefix = corpus / "mega_text_document"
    idx = Path(f"{prefix}.idx")
    args = ["megatron:mega_text_document", "out", "--tokenizer", "text_shards/tokenizer.json"]
    if damage == "tokenizer":
        args[-1] = "bytes"  # ids past 255
    elif damage == "magic":
        idx.write_bytes(b"XX" + idx.read_bytes()[2:])
    elif damage == "truncate":
        idx.write_bytes(idx.read_bytes()[:-9])
    elif damage == "pointers":
        raw = bytearray(idx.read_bytes())
        n_seq = struct.unpack_from("<Q", raw, 18)[0]
        struct.pack_into("<q", raw, 34 + 4 * n_seq + 8 * (n_seq - 1), 1 << 40)
        idx.write_bytes(bytes(raw))
    elif damage == "missing":
        Path(f"{prefix}.bin").unlink()
    elif damage == "train":
        args += ["--train-tokenizer", "300"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        prepare(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (corpus / "out/meta.json").exists()
