"""Data mixtures: several prepared corpora drawn by weight, behind TokenData's interface.

Each sequence of a step's global batch picks its source by weight and its offset inside that
source, both from generators seeded by (seed, step): the batch stays a pure function of
(seed, step), so resume and every layout see the same data. Validation runs per source on fixed
sequences; the target mixture's loss is the target-weighted mean of the per-source losses (an
exact expectation, not another sample), logged as `val_loss` so that sweeps minimize it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np

from workbench.config import DataConfig
from workbench.data.order import epoch_starts
from workbench.data.shards import atomic_write
from workbench.data.tokens import TokenData, batch_offsets, cache_root, gather, open_corpus
from workbench.errors import ConfigError

STREAM_SOURCE, STREAM_OFFSET = 2, 3  # generator streams distinct from batch_offsets' 0 and 1


def normalized(weights: Dict[str, float], names: List[str], key: str) -> np.ndarray:
    """Weights in source order, summing to 1; missing names weigh 0."""
    w = np.array([float(weights.get(n, 0.0)) for n in names])
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ConfigError(key, dict(weights), "weights must be >= 0 and sum to a positive number")
    return w / w.sum()


@dataclass(frozen=True)
class Mixture:
    folder: Path  # holds mixture.json: what a job file points at
    names: Tuple[str, ...]
    sources: Tuple[TokenData, ...]
    weights: Tuple[float, ...]  # normalized
    target: Tuple[float, ...]  # normalized: the mixture val_loss is measured for
    vocab: int
    fingerprint: str
    tokenizer_hash: str
    tokenizer: str

    @property
    def train(self):  # the first source's splits, for code that reads one corpus
        return self.sources[0].train

    @property
    def val(self):
        return self.sources[0].val

    @property
    def train_tokens(self) -> int:
        """Every source's training tokens together (passes over the mixture's text)."""
        return sum(s.train.n_tokens for s in self.sources)

    def offsets(self, seed: int, split: str, step: int, count: int, seq_len: int,
                order: str = "random") -> np.ndarray:
        """(count, 2) rows of (source index, start offset), a pure function of (seed, step).
        Under `epochs` a source's windows follow its own epoch permutation, indexed by the global
        sequence index: no window of a source repeats until as many sequences as it has windows
        have been drawn from the whole mixture."""
        if split.startswith("val:"):
            k = int(split[4:])
            starts = batch_offsets(seed + 7919 * k, "val", step, count,
                                   self.sources[k].val.n_tokens, seq_len, order)
            return np.stack([np.full(count, k), starts], axis=1)
        w = np.array(self.weights if split == "train" else self.target)
        which = np.random.default_rng([seed, STREAM_SOURCE, step]).choice(len(w), count, p=w)
        rows = np.zeros((count, 2), dtype=np.int64)
        rows[:, 0] = which
        for k, data in enumerate(self.sources):
            n = (data.train if split == "train" else data.val).n_tokens
            mine = which == k
            if mine.any():
                if n <= seq_len + 1:
                    raise FileNotFoundError(f"data.sources.{self.names[k]}: {split} has {n} "
                                            f"tokens, fewer than model.seq_len + 1")
                if order == "epochs":
                    rows[mine, 1] = epoch_starts(seed, STREAM_OFFSET + 2 * k + (split != "train"),
                                                 step * count, count, n, seq_len)[mine]
                    continue
                rng = np.random.default_rng([seed, STREAM_OFFSET, k, step])
                rows[mine, 1] = rng.integers(0, n - seq_len - 1, size=count)[:mine.sum()]
        return rows

    def gather(self, split: str, rows: np.ndarray, seq_len: int) -> Tuple[np.ndarray,
                                                                          np.ndarray]:
        x = np.empty((len(rows), seq_len), dtype=np.int64)
        y = np.empty_like(x)
        part = "train" if split == "train" else "val"
        for k in np.unique(rows[:, 0]):
            mine = rows[:, 0] == k
            src = self.sources[int(k)]
            x[mine], y[mine] = gather(src._arrays[part], rows[mine, 1], seq_len)
        return x, y

    def val_losses(self, loss_of: Callable[[str], float]) -> Dict[str, float]:
        """Per-source validation losses and the target mixture's (their weighted mean)."""
        per = {name: loss_of(f"val:{k}") for k, name in enumerate(self.names)}
        out = {f"val_loss/{name}": v for name, v in per.items()}
        out["val_loss"] = float(sum(t * per[n] for t, n in zip(self.target, self.names)))
        return out


def _open_source(cfg: DataConfig, name: str, spec: str) -> TokenData:
    if spec.startswith("stdlib:"):
        from workbench.data.stdlib import part_tokens

        return part_tokens(cfg, spec[len("stdlib:"):])
    try:
        data = open_corpus(Path(spec))
    except FileNotFoundError as e:
        raise ConfigError(f"data.sources.{name}", spec, str(e).split(": ", 1)[-1]) from None
    if not isinstance(data, TokenData):
        raise ConfigError(f"data.sources.{name}", spec, "a source must be one corpus")
    return data


def build_mixture(cfg: DataConfig) -> Mixture:
    """Open every source, check they share one tokenizer, and record the mixture in a folder
    named by its content (so a job file can point at it like at any data folder)."""
    names = sorted(cfg.sources)
    sources = [_open_source(cfg, n, cfg.sources[n]) for n in names]
    hashes = {d.tokenizer_hash for d in sources}
    if len(hashes) > 1:
        detail = ", ".join(f"{n}: {d.tokenizer} {d.tokenizer_hash[:8]}"
                           for n, d in zip(names, sources))
        raise ConfigError("data.sources", dict(cfg.sources),
                          f"all sources need one tokenizer ({detail})")
    weights = normalized(cfg.weights or {n: 1.0 for n in names}, names, "data.weights")
    target = normalized(cfg.target, names, "data.target") if cfg.target else weights
    spec = {"names": names, "folders": [str(d.folder.resolve()) for d in sources],
            "fingerprints": [d.fingerprint for d in sources],
            "weights": [float(w) for w in weights], "target": [float(t) for t in target]}
    blob = json.dumps(spec, sort_keys=True).encode()
    folder = cache_root(cfg) / f"mixture-{hashlib.sha256(blob).hexdigest()[:16]}"
    if not (folder / "mixture.json").exists():
        atomic_write(folder / "mixture.json", blob)
    return open_mixture(folder)


def open_mixture(folder: Path) -> Mixture:
    spec = json.loads((Path(folder) / "mixture.json").read_text())
    sources = tuple(open_corpus(Path(f)) for f in spec["folders"])
    for d, fp in zip(sources, spec["fingerprints"]):
        if d.fingerprint != fp:
            raise FileNotFoundError(f"data: source {str(d.folder)!r} changed since the mixture "
                                    "was recorded")
    sha = hashlib.sha256()
    for name, d, w in zip(spec["names"], sources, spec["weights"]):
        sha.update(f"{name}|{d.fingerprint}|{w!r}".encode())
    return Mixture(Path(folder), tuple(spec["names"]), sources, tuple(spec["weights"]),
                   tuple(spec["target"]), max(d.vocab for d in sources), sha.hexdigest(),
                   sources[0].tokenizer_hash, sources[0].tokenizer)
