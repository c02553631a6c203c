"""Token data as uint16/uint32 memmaps with a JSON sidecar, and the embedded default corpus.

The default corpus is the Python standard library's own source: real text on every machine with
Python, so a dry run needs no download. It is tokenized at byte level once and cached; its
sha256 fingerprint goes into every run's manifest, because another Python version gives other
text.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Tuple

import numpy as np

from workbench.config import DataConfig

SCHEME = "bytes-v1"  # byte-level tokens; vocab 256


@dataclass(frozen=True)
class TokenSplit:
    """One memmapped split; opened lazily so a job file stays a plain path."""

    path: Path
    dtype: str
    n_tokens: int

    def array(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


@dataclass(frozen=True)
class TokenData:
    folder: Path
    train: TokenSplit
    val: TokenSplit
    vocab: int
    fingerprint: str  # sha256 over both splits' bytes


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    env = os.environ.get("WORKBENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "workbench"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_val(name: str, val_frac: float) -> bool:
    """A file goes to validation by a hash of its name: stable, whatever the file order."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return h / 2**32 < val_frac


def write_shards(texts: Iterable[Tuple[str, bytes]], out: Path, val_frac: float,
                 max_bytes: int, source: str) -> TokenData:
    """Byte-tokenize (name, bytes) pairs into train.bin/val.bin + meta.json, atomically."""
    train: List[bytes] = []
    val: List[bytes] = []
    total = 0
    for name, data in texts:
        if total >= max_bytes:
            break
        data = data[: max_bytes - total]
        total += len(data)
        (val if _is_val(name, val_frac) else train).append(data + b"\n")
    if not val and train:  # tiny inputs: keep at least one file for validation
        val.append(train.pop())
    if not train or not val:
        raise FileNotFoundError(f"data: no text files found for {source}")
    sha = hashlib.sha256()
    sizes = {}
    for split, parts in (("train", train), ("val", val)):
        arr = np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.uint16)
        raw = arr.tobytes()
        sha.update(raw)
        _atomic_write_bytes(out / f"{split}.bin", raw)
        sizes[split] = int(arr.size)
    meta = {"scheme": SCHEME, "dtype": "uint16", "vocab": 256, "source": source,
            "train_tokens": sizes["train"], "val_tokens": sizes["val"],
            "fingerprint": sha.hexdigest()}
    _atomic_write_bytes(out / "meta.json", json.dumps(meta, indent=1).encode())
    return open_tokens(out)


def open_tokens(folder: Path) -> TokenData:
    """Open a shard folder; a missing or malformed sidecar is bad input, not a crash."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"data.path={str(folder)!r}: no meta.json; build it with "
                                "python -m workbench.data.prepare SRC OUT")
    try:
        meta = json.loads(meta_path.read_text())
        dtype = meta["dtype"]
        splits = {s: TokenSplit(folder / f"{s}.bin", dtype, int(meta[f"{s}_tokens"]))
                  for s in ("train", "val")}
    except (ValueError, KeyError) as e:
        raise FileNotFoundError(f"data.path={str(folder)!r}: malformed meta.json ({e})") from None
    for s in splits.values():
        expect = s.n_tokens * np.dtype(s.dtype).itemsize
        if not s.path.exists() or s.path.stat().st_size != expect:
            raise FileNotFoundError(f"data.path={str(folder)!r}: {s.path.name} missing or not "
                                    f"{expect} bytes")
    return TokenData(folder, splits["train"], splits["val"], int(meta["vocab"]),
                     meta["fingerprint"])


def _stdlib_files() -> List[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "idlelib", "test", "tests"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def stdlib_tokens(cfg: DataConfig) -> TokenData:
    """The embedded corpus, built on first use and cached by (Python version, size, split)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tag = hashlib.sha256(f"{SCHEME}|{sys.version}|{root}|{cfg.max_bytes}|{cfg.val_frac}".encode())
    out = cache_root(cfg) / f"stdlib-{tag.hexdigest()[:16]}"
    if (out / "meta.json").exists():
        return open_tokens(out)
    texts = ((str(p.relative_to(root)), p.read_bytes()) for p in _stdlib_files())
    return write_shards(texts, out, cfg.val_frac, cfg.max_bytes, f"python-stdlib {root}")


def load(cfg: DataConfig) -> TokenData:
    if cfg.name == "stdlib":
        return stdlib_tokens(cfg)
    return open_tokens(Path(cfg.path))


def batch_offsets(seed: int, split: str, step: int, count: int, n_tokens: int,
                  seq_len: int) -> np.ndarray:
    """Start offsets of the `count` sequences of one step: a pure function of (seed, step), so
    resume needs no data-loader state and every layout sees the same global batch."""
    if n_tokens <= seq_len + 1:
        raise FileNotFoundError(f"data: split {split} has {n_tokens} tokens, fewer than "
                                f"model.seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)


def gather(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> Tuple[np.ndarray,
                                                                           np.ndarray]:
    """(inputs, targets) int64 arrays of shape (len(offsets), seq_len)."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    window = tokens[idx].astype(np.int64)
    return window[:, :-1], window[:, 1:]
