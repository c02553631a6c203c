"""A Megatron-LM / NeMo indexed dataset (PREFIX.bin + PREFIX.idx) as shards, without tokenizing
again: `python -m workbench.data.prepare megatron:PREFIX OUT --tokenizer T`.

Teams that train with Megatron-derived stacks keep their corpora in this format, often
tokenized at a cost of thousands of core-hours; comparing a run here with one there should not
need that done again, nor risk a different tokenization. The .idx file holds, after a 9-byte
magic, a version (u64, 1), the ids' dtype code (u8), the number of sequences and of document
boundaries (u64 each), then the length of every sequence (int32), its byte offset in the .bin
(int64) and the sequence index where each document starts, with a final boundary (int64).

Each document becomes one document of the shards: its ids, then the tokenizer's end-of-text id
unless Megatron's `--append-eod` already put it there. Validation holds whole documents, chosen
by a hash of their index as for text sources; an id the tokenizer does not have is an error,
since it means `--tokenizer` is not the one that made the corpus.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from workbench.data.shards import (
    atomic_write,
    commit_shard,
    finish,
    finished,
    is_val,
    shard_name,
    start,
)
from workbench.data.tokenizer import Tok
from workbench.errors import InputError

MAGIC = b"MMIDIDX\x00\x00"
# Megatron's dtype codes for the ids in the .bin (the float codes are not token ids).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
PREFIX = "megatron:"


@dataclass(frozen=True)
class Indexed:
    """The .bin memory-mapped as its ids, and the .idx arrays that cut it into documents."""

    ids: np.ndarray
    lengths: np.ndarray  # tokens per sequence
    offsets: np.ndarray  # each sequence's first id (the .idx's byte offsets / itemsize)
    doc_starts: np.ndarray  # document d is sequences [doc_starts[d], doc_starts[d + 1])

    def __len__(self) -> int:
        return len(self.doc_starts) - 1

    def document(self, d: int) -> np.ndarray:
        first, end = int(self.doc_starts[d]), int(self.doc_starts[d + 1])
        parts = [self.ids[o:o + n] for o, n in zip(self.offsets[first:end],
                                                     self.lengths[first:end])]
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def read(prefix: str) -> Indexed:
    """PREFIX.idx parsed and checked against PREFIX.bin; a bad file is one line."""
    idx, binary = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, binary):
        if not p.is_file():
            raise InputError(f"src={PREFIX}{prefix}: {p} does not exist (give the path without "
                             ".bin/.idx)")
    raw = idx.read_bytes()
    head = len(MAGIC) + 8 + 1 + 8 + 8
    if raw[:len(MAGIC)] != MAGIC or len(raw) < head:
        raise InputError(f"src={PREFIX}{prefix}: {idx} is not a Megatron index (MMIDIDX) file")
    version, code, n_seq, n_bounds = struct.unpack_from("<QBQQ", raw, len(MAGIC))
    if version != 1 or code not in DTYPES:
        raise InputError(f"src={PREFIX}{prefix}: index version {version}, dtype code {code}: "
                         f"version 1 with integer ids ({sorted(DTYPES)}) is readable")
    need = head + 4 * n_seq + 8 * n_seq + 8 * n_bounds
    if len(raw) < need or n_bounds < 1:
        raise InputError(f"src={PREFIX}{prefix}: {idx} is truncated ({len(raw)} of {need} "
                         "bytes)")
    dtype = np.dtype(DTYPES[code])
    lengths = np.frombuffer(raw, np.int32, n_seq, head).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, n_seq, head + 4 * n_seq)
    starts = np.frombuffer(raw, np.int64, n_bounds, head + 12 * n_seq)
    size = binary.stat().st_size
    ends = pointers + lengths * dtype.itemsize
    if (n_seq and (ends.max() > size or pointers.min() < 0 or (pointers % dtype.itemsize).any())) \
            or starts[0] != 0 or starts[-1] != n_seq or (np.diff(starts) < 0).any():
        raise InputError(f"src={PREFIX}{prefix}: {idx} does not describe {binary} ({size} bytes)")
    ids = np.memmap(binary, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    return Indexed(ids, lengths, pointers // dtype.itemsize, starts)


def fingerprint(prefix: str) -> str:
    """Both files' contents, as text sources are fingerprinted by theirs."""
    sha = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        with open(prefix + suffix, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
    return sha.hexdigest()


def _documents(ix: Indexed, tok: Tok, prefix: str) -> Iterator[Tuple[int, np.ndarray]]:
    """(index, ids + end-of-text) per non-empty document, checked against the vocabulary."""
    eot = np.array([tok.eot_id], tok.dtype)
    for d in range(len(ix)):
        doc = ix.document(d)
        if not len(doc):
            continue
        low, high = int(doc.min()), int(doc.max())
        if low < 0 or high >= tok.vocab:
            raise InputError(f"src={PREFIX}{prefix}: document {d} holds id "
                             f"{high if high >= tok.vocab else low}, outside --tokenizer "
                             f"{tok.name!r} (vocab {tok.vocab}): not the tokenizer that made it")
        doc = doc.astype(tok.dtype, copy=False)
        yield d, doc if doc[-1] == tok.eot_id else np.concatenate([doc, eot])


class _Splits:
    """Documents routed to train/val and cut into shards of about `shard_tokens` ids; a shard
    an earlier, killed import finished is kept."""

    def __init__(self, out: Path, itemsize: int, shard_tokens: int):
        self.out, self.itemsize, self.shard_tokens = out, itemsize, shard_tokens
        self.buf: Dict[str, List[np.ndarray]] = {"train": [], "val": []}
        self.size = {"train": 0, "val": 0}
        self.done: Dict[str, List[Dict[str, Any]]] = {"train": [], "val": []}

    def add(self, split: str, doc: np.ndarray) -> None:
        self.buf[split].append(doc)
        self.size[split] += len(doc)
        if self.size[split] >= self.shard_tokens:
            self.flush(split)

    def flush(self, split: str) -> None:
        if self.buf[split]:
            name = shard_name(split, len(self.done[split]))
            info = finished(self.out, name, self.itemsize)
            self.done[split].append(info or commit_shard(
                self.out, name, [np.concatenate(self.buf[split]).tobytes()], self.itemsize,
                len(self.buf[split])))
            self.buf[split], self.size[split] = [], 0


def prepare(prefix: str, out: Path, tok: Tok, val_frac: float,
            shard_bytes: int) -> Dict[str, Any]:
    """Import PREFIX into OUT as shards with meta.json; returns the meta (an unchanged,
    finished OUT is returned as it is)."""
    ix = read(prefix)
    source = {"kind": "megatron", "name": PREFIX + prefix, "fingerprint": fingerprint(prefix),
              "documents": len(ix)}
    settings = {"tokenizer": tok.sha256, "source": source["fingerprint"], "val_frac": val_frac,
                "shard_bytes": shard_bytes, "version": 2, "import": "megatron"}
    meta = start(out, settings)
    if meta is not None:
        return meta
    if tok.json is not None:
        atomic_write(out / "tokenizer.json", tok.json.encode())
    itemsize = np.dtype(tok.dtype).itemsize
    splits = _Splits(out, itemsize, max(1, shard_bytes // itemsize))
    held: Optional[np.ndarray] = None  # the last train document: validation's if none is
    for d, doc in _documents(ix, tok, prefix):
        if is_val(f"{prefix}#{d}", val_frac):
            splits.add("val", doc)
            continue
        if held is not None:
            splits.add("train", held)
        held = doc
    if held is not None:
        splits.add("val" if not splits.done["val"] and not splits.buf["val"] else "train", held)
    for split in ("train", "val"):
        splits.flush(split)
    if not splits.done["train"] or not splits.done["val"]:
        raise InputError(f"src={PREFIX}{prefix}: needs at least 2 non-empty documents "
                         f"(found {len(ix)})")
    return finish(out, tok, source, settings, splits.done)
