"""One corpus's token data: uint16/uint32 memmapped shards with a JSON sidecar, read as one
virtual array.

What the training loop needs from data is small: a step's (source, offset) pairs as a pure
function of (seed, step) (resume needs no loader state and every layout sees the same global
batch), the windows at those offsets, and validation losses. `TokenData` is one prepared corpus;
`workbench.data.mixture.Mixture` is several drawn by weight, behind the same three methods.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np

from workbench import places
from workbench.config import DataConfig
from workbench.data.order import epoch_starts
from workbench.data.shards import atomic_write
from workbench.data.tokenizer import bytes_tokenizer

SCHEME = "bytes-v1"  # the legacy single-file layout: train.bin/val.bin, byte-level, vocab 256


class ShardedTokens:
    """Several memmapped shard files as one array of tokens (len, shape, windows)."""

    def __init__(self, parts: List[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def window(self, start: int, length: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        out, pos = [], start
        while length > 0:  # a window may cross a shard boundary
            local = pos - int(self.starts[k])
            piece = self.parts[k][local:local + length]
            out.append(piece)
            length -= len(piece)
            pos += len(piece)
            k += 1
        return np.concatenate(out) if len(out) > 1 else out[0]


@dataclass(frozen=True)
class TokenSplit:
    """One split: its shard files, opened lazily so a job file stays a plain path."""

    files: Tuple[Path, ...]
    counts: Tuple[int, ...]
    dtype: str

    @property
    def n_tokens(self) -> int:
        return int(sum(self.counts))

    @property
    def path(self) -> Path:
        return self.files[0]

    def array(self):
        maps = [np.memmap(f, dtype=self.dtype, mode="r", shape=(n,))
                for f, n in zip(self.files, self.counts) if n]
        return maps[0] if len(maps) == 1 else ShardedTokens(maps)


@dataclass(frozen=True)
class TokenData:
    folder: Path
    train: TokenSplit
    val: TokenSplit
    vocab: int
    fingerprint: str  # sha256 over the shards' bytes
    tokenizer_hash: str = ""  # sha256 of the tokenizer's serialization
    tokenizer: str = "bytes"
    meta: Dict = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def _arrays(self) -> Dict[str, object]:
        return {"train": self.train.array(), "val": self.val.array()}

    @property
    def train_tokens(self) -> int:
        """Tokens of training text: a run's `epochs` metric counts passes over them."""
        return self.train.n_tokens

    def offsets(self, seed: int, split: str, step: int, count: int, seq_len: int,
                order: str = "random") -> np.ndarray:
        """(count, 2) int64 rows of (source, start offset); one source here, index 0."""
        n = self.train.n_tokens if split == "train" else self.val.n_tokens
        starts = batch_offsets(seed, split, step, count, n, seq_len, order)
        return np.stack([np.zeros_like(starts), starts], axis=1)

    def gather(self, split: str, rows: np.ndarray, seq_len: int) -> Tuple[np.ndarray,
                                                                          np.ndarray]:
        return gather(self._arrays["train" if split == "train" else "val"], rows[:, 1], seq_len)

    def val_losses(self, loss_of: Callable[[str], float]) -> Dict[str, float]:
        """Validation metrics given `loss_of(split)`: one corpus, one val_loss."""
        return {"val_loss": loss_of("val")}


def cache_root(cfg: DataConfig) -> Path:
    return places.cache_root(cfg.cache_dir)


def write_shards(texts, out: Path, val_frac: float, max_bytes: int, source: str) -> TokenData:
    """Byte-tokenize (name, bytes) pairs into train.bin/val.bin + meta.json (the legacy layout
    of the embedded default corpus, kept so its runs stay bitwise what they were)."""
    from workbench.data.shards import capped, is_val

    train: List[bytes] = []
    val: List[bytes] = []
    for name, data in capped(texts, max_bytes):
        (val if is_val(name, val_frac) else train).append(data + b"\n")
    if not val and train:  # tiny inputs: keep at least one file for validation
        val.append(train.pop())
    if not train or not val:
        raise FileNotFoundError(f"data: no text files found for {source}")
    import hashlib

    sha = hashlib.sha256()
    sizes = {}
    for split, parts in (("train", train), ("val", val)):
        arr = np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.uint16)
        raw = arr.tobytes()
        sha.update(raw)
        atomic_write(out / f"{split}.bin", raw)
        sizes[split] = int(arr.size)
    meta = {"scheme": SCHEME, "dtype": "uint16", "vocab": 256, "source": source,
            "train_tokens": sizes["train"], "val_tokens": sizes["val"],
            "train_docs": len(train), "val_docs": len(val), "fingerprint": sha.hexdigest()}
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    return open_corpus(out)


def _splits(folder: Path, meta: Dict) -> Dict[str, TokenSplit]:
    dtype = meta["dtype"]
    if "shards" in meta:
        return {s: TokenSplit(tuple(folder / x["file"] for x in meta["shards"][s]),
                              tuple(int(x["tokens"]) for x in meta["shards"][s]), dtype)
                for s in ("train", "val")}
    return {s: TokenSplit((folder / f"{s}.bin",), (int(meta[f"{s}_tokens"]),), dtype)
            for s in ("train", "val")}


def open_corpus(folder: Path) -> TokenData:
    """Open one shard folder; a missing or malformed sidecar is bad input."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"data.path={str(folder)!r}: no meta.json; build it with "
                                "python -m workbench.data.prepare SRC OUT")
    try:
        meta = json.loads(meta_path.read_text())
        splits = _splits(folder, meta)
        tok = meta.get("tokenizer", {})
    except (ValueError, KeyError, TypeError) as e:
        raise FileNotFoundError(f"data.path={str(folder)!r}: malformed meta.json ({e})") from None
    for s in splits.values():
        for f, n in zip(s.files, s.counts):
            expect = n * np.dtype(s.dtype).itemsize
            if not f.exists() or f.stat().st_size != expect:
                raise FileNotFoundError(f"data.path={str(folder)!r}: {f.name} missing or not "
                                        f"{expect} bytes")
    return TokenData(folder, splits["train"], splits["val"], int(meta["vocab"]),
                     meta["fingerprint"], tok.get("sha256") or bytes_tokenizer().sha256,
                     tok.get("name", "bytes"), meta)


def batch_offsets(seed: int, split: str, step: int, count: int, n_tokens: int,
                  seq_len: int, order: str = "random") -> np.ndarray:
    """Start offsets of the `count` sequences of one step: a pure function of (seed, step), so
    resume needs no data-loader state and every layout sees the same global batch; `order` as
    in workbench.data.order (the step's sequences are global indices step*count onwards)."""
    if n_tokens <= seq_len + 1:
        raise FileNotFoundError(f"data: split {split} has {n_tokens} tokens, fewer than "
                                f"model.seq_len + 1 = {seq_len + 1}")
    stream = 0 if split == "train" else 1
    if order == "epochs":
        return epoch_starts(seed, stream, step * count, count, n_tokens, seq_len)
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)


def gather(tokens, offsets: np.ndarray, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int64 arrays of shape (len(offsets), seq_len)."""
    if isinstance(tokens, ShardedTokens):
        window = np.stack([tokens.window(int(o), seq_len + 1) for o in offsets]).astype(np.int64)
    else:
        idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
        window = tokens[idx].astype(np.int64)
    return window[:, :-1], window[:, 1:]


def resolve_vocab(model_vocab: int, data, overrides: List[str]) -> int:
    """model.vocab for this data: the data's own unless the user set model.vocab on the command
    line (then it must hold every token id: a larger one is padding, a smaller one an error)."""
    from workbench.errors import ConfigError

    explicit = any(o.lstrip("+~").split("=", 1)[0] == "model.vocab" for o in overrides)
    if explicit or data.vocab == model_vocab:
        if data.vocab > model_vocab:
            raise ConfigError("model.vocab", model_vocab,
                              f"must be >= the data's vocabulary ({data.vocab}, tokenizer "
                              f"{data.tokenizer})")
        return model_vocab
    return int(data.vocab)
