"""Token shards at corpus scale: documents in, numbered shard files out, written by all cores.

Memory stays bounded whatever the corpus size: documents stream in, a shard's text is handed to
a worker once it reaches `shard_bytes`, and at most two shards per worker are in flight. Every
file appears by rename only when complete, so a reader (or a resumed prepare) never sees half a
shard; a killed prepare resumes by keeping the shards that exist and redoing the rest, giving
files byte-identical to an uninterrupted one because shard boundaries depend on the documents
only. meta.json is written last: its presence is what makes the folder a dataset.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from workbench.data.tokenizer import Encoder, Tok
from workbench.errors import InputError

STATE = ".prepare.json"  # settings of an unfinished prepare; resuming needs the same ones
ENCODE_CHARS = 1 << 20  # text per encode_batch call inside a worker: bounds its memory


def capped(docs: Iterable[Tuple[str, Any]], max_units: int) -> Iterable[Tuple[str, Any]]:
    """(key, text or bytes) documents until `max_units` characters or bytes have passed; the
    last one is cut to fit, so a size limit is exact whatever the documents' lengths."""
    total = 0
    for key, text in docs:
        if total >= max_units:
            return
        text = text[: max_units - total]
        total += len(text)
        yield key, text


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def is_val(key: str, val_frac: float) -> bool:
    """A document goes to validation by a hash of its key: held out whole, stable in any order."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    return h / 2**32 < val_frac


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def finished(out: Path, name: str, itemsize: int) -> Optional[Dict[str, Any]]:
    side, data = out / f"{name}.json", out / name
    if not (side.exists() and data.exists()):
        return None
    info = json.loads(side.read_text())
    return info if data.stat().st_size == info["tokens"] * itemsize else None


_ENCODER: Optional[Encoder] = None


def _init_worker(tok: Tok) -> None:
    global _ENCODER
    _ENCODER = Encoder(tok)


def _write_shard(out: Path, name: str, docs: List[str]) -> Dict[str, Any]:
    """Encode one shard's documents, a batch of about ENCODE_CHARS at a time, and commit it."""
    assert _ENCODER is not None
    enc = _ENCODER

    def chunks() -> Iterator[bytes]:
        i = 0
        while i < len(docs):
            j, size = i, 0
            while j < len(docs) and (size < ENCODE_CHARS or j == i):
                size += len(docs[j])
                j += 1
            yield enc.encode(docs[i:j]).tobytes()
            i = j

    return commit_shard(out, name, chunks(), np.dtype(enc.tok.dtype).itemsize, len(docs))


def commit_shard(out: Path, name: str, chunks: Iterable[bytes], itemsize: int,
                 docs: int) -> Dict[str, Any]:
    """Write a shard's bytes atomically, sidecar first (the .bin's rename is the commit): a
    killed prepare or import leaves either the whole shard or none of it."""
    sha = hashlib.sha256()
    n = 0
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as f:
        for raw in chunks:
            sha.update(raw)
            f.write(raw)
            n += len(raw) // itemsize
        f.flush()
        os.fsync(f.fileno())
    info = {"file": name, "tokens": n, "docs": docs, "sha256": sha.hexdigest()}
    atomic_write(out / f"{name}.json", json.dumps(info).encode())
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / name)
    return info


def start(out: Path, settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Reuse a finished folder with the same settings, resume an unfinished one, or clear it."""
    out.mkdir(parents=True, exist_ok=True)
    meta_path, state = out / "meta.json", out / STATE
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings:
            return meta
    same = state.exists() and json.loads(state.read_text()) == settings
    stale = list(out.glob(".*-[0-9][0-9][0-9][0-9][0-9].bin*"))  # temporaries of a killed run
    if not same:
        stale += list(out.glob("*-[0-9][0-9][0-9][0-9][0-9].bin*"))
    for p in stale:
        p.unlink()
    if meta_path.exists():
        meta_path.unlink()
    atomic_write(state, json.dumps(settings, sort_keys=True).encode())
    return None


class _Writer:
    """Routes documents to train/val shards and hands full shards to the pool (or inline)."""

    def __init__(self, out: Path, tok: Tok, shard_bytes: int, workers: int):
        self.out, self.tok, self.shard_bytes = out, tok, shard_bytes
        self.buf: Dict[str, List[str]] = {"train": [], "val": []}
        self.size = {"train": 0, "val": 0}
        self.index = {"train": 0, "val": 0}
        self.done: Dict[str, Dict[int, Dict[str, Any]]] = {"train": {}, "val": {}}
        self.pending: Deque[Tuple[str, int, Any]] = deque()
        self.workers = workers
        self.pool = None
        if workers > 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
            self.pool = mp.get_context("fork").Pool(workers, _init_worker, (tok,))
        else:
            _init_worker(tok)

    def add(self, split: str, text: str) -> None:
        self.buf[split].append(text)
        self.size[split] += len(text)
        if self.size[split] >= self.shard_bytes:
            self.flush(split)

    def flush(self, split: str) -> None:
        docs, idx = self.buf[split], self.index[split]
        self.buf[split], self.size[split] = [], 0
        if not docs:
            return
        self.index[split] += 1
        name = shard_name(split, idx)
        info = finished(self.out, name, np.dtype(self.tok.dtype).itemsize)
        if info is not None:  # kept from an earlier, killed prepare
            self.done[split][idx] = info
        elif self.pool is None:
            self.done[split][idx] = _write_shard(self.out, name, docs)
        else:
            while len(self.pending) >= 2 * self.workers:
                self._collect_one()
            self.pending.append((split, idx, self.pool.apply_async(
                _write_shard, (self.out, name, docs))))

    def _collect_one(self) -> None:
        split, idx, res = self.pending.popleft()
        self.done[split][idx] = res.get()

    def close(self) -> Dict[str, List[Dict[str, Any]]]:
        for split in ("train", "val"):
            self.flush(split)
        try:
            while self.pending:
                self._collect_one()
        finally:
            if self.pool is not None:
                self.pool.terminate()
        return {s: [self.done[s][i] for i in sorted(self.done[s])] for s in ("train", "val")}


def write(docs: Iterable[Tuple[str, str]], out: Path, tok: Tok, source: Dict[str, Any],
          val_frac: float, shard_bytes: int = 32 << 20, workers: int = 0,
          progress: bool = True) -> Dict[str, Any]:
    """Tokenize (key, text) documents into OUT/{train,val}-NNNNN.bin + meta.json; returns meta.

    The last train document is held back until the next arrives, so that a corpus whose hashes
    put no document in validation still gets one (tiny inputs), deterministically."""
    from tqdm import tqdm

    settings = {"tokenizer": tok.sha256, "source": source.get("fingerprint", ""),
                "val_frac": val_frac, "shard_bytes": shard_bytes, "version": 2}
    meta = start(out, settings)
    if meta is not None:
        return meta
    if tok.json is not None:
        atomic_write(out / "tokenizer.json", tok.json.encode())
    writer = _Writer(out, tok, shard_bytes, workers or os.cpu_count() or 1)
    held: Optional[str] = None
    n_val = 0
    try:
        with tqdm(desc="prepare", unit="B", unit_scale=True, disable=None if progress else True,
                  mininterval=1.0) as bar:
            for key, text in docs:
                bar.update(len(text))
                if is_val(key, val_frac):
                    writer.add("val", text)
                    n_val += 1
                    continue
                if held is not None:
                    writer.add("train", held)
                held = text
            if held is not None:
                writer.add("val" if n_val == 0 else "train", held)
        shards = writer.close()
    except BaseException:
        if writer.pool is not None:
            writer.pool.terminate()
        raise
    if not shards["train"] or not shards["val"]:
        raise InputError(f"source {source.get('name', '')!r}: needs at least 2 non-empty "
                         f"documents (found {sum(len(v) for v in shards.values())} shards)")
    return finish(out, tok, source, settings, shards)


def finish(out: Path, tok: Tok, source: Dict[str, Any], settings: Dict[str, Any],
            shards: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    sha = hashlib.sha256()
    for split in ("train", "val"):
        for s in shards[split]:
            sha.update(s["sha256"].encode())
    meta = {"scheme": "shards-v2", "dtype": tok.dtype, "vocab": tok.vocab,
            "tokenizer": {"name": tok.name, "sha256": tok.sha256, "vocab": tok.vocab,
                          "eot_id": tok.eot_id},
            "source": source, "settings": settings, "fingerprint": sha.hexdigest(),
            "shards": {s: [{"file": x["file"], "tokens": x["tokens"], "docs": x["docs"]}
                           for x in shards[s]] for s in ("train", "val")}}
    for split in ("train", "val"):
        meta[f"{split}_tokens"] = sum(x["tokens"] for x in shards[split])
        meta[f"{split}_docs"] = sum(x["docs"] for x in shards[split])
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    (out / STATE).unlink(missing_ok=True)
    return meta
