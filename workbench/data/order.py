"""Which windows of a corpus a step reads: `data.order=random` or `data.order=epochs`.

`random` draws every sequence's start uniformly over the corpus, with replacement: cheap, and
the embedded default's recorded losses depend on it. Over one pass of a real corpus it reads
about 1 - 1/e = 63% of the text and some of it twice or more, so two runs that differ in a
trick also differ in which text they saw. `epochs` cuts the corpus into non-overlapping windows
of seq_len + 1 tokens (one token shared between neighbours, as input and target) and visits each
once per epoch, in an order seeded per epoch.

Both stay a pure function of (seed, split, global sequence index): resume needs no loader state
and every layout reads the same global batch. The epoch order is a keyed Feistel permutation of
the window indices with cycle walking, so a 10^12-token corpus needs no 10^8-entry shuffle table
in memory: each index is permuted on its own in a few vectorized integer operations.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4  # Feistel rounds; 4 with a strong round function is a pseudo-random permutation
_M64 = (1 << 64) - 1
EPOCH_TAG = 0xE9  # a 4-word generator seed: never the 3-word (seed, stream, step) of `random`


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit avalanche (splitmix64's finalizer) of x + key: the Feistel round function."""
    z = (x + np.uint64(key & _M64)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(idx: np.ndarray, n: int, keys: tuple[int, ...]) -> np.ndarray:
    """idx (values in [0, n)) through a pseudo-random permutation of [0, n) chosen by `keys`
    (one per round): a Feistel network over the smallest even bit width covering n, applied
    again to any value that lands at or past n (cycle walking keeps it a permutation of [0, n))."""
    if n <= 1:
        return np.zeros(len(idx), dtype=np.int64)
    half = (max(int(n - 1).bit_length(), 2) + 1) // 2
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    x = np.asarray(idx, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            left, right = x[todo] >> shift, x[todo] & mask
            for key in keys:
                left, right = right, left ^ (_mix(right, key) & mask)
            x[todo] = (left << shift) | right
            todo[todo] = x[todo] >= np.uint64(n)
    return x.astype(np.int64)


def epoch_keys(seed: int, stream: int, epoch: int) -> tuple[int, ...]:
    """The round keys of one epoch's permutation: a new order every epoch, fixed by the seed."""
    rng = np.random.default_rng([seed, stream, epoch, EPOCH_TAG])
    return tuple(int(k) for k in rng.integers(0, 2**63, size=ROUNDS, dtype=np.int64))


def epoch_starts(seed: int, stream: int, first: int, count: int, n_tokens: int,
                 seq_len: int) -> np.ndarray:
    """Start offsets of global sequences first .. first + count - 1 under `epochs`: sequence g
    reads window perm_e(g mod W) of W = (n_tokens - 1) // seq_len, e = g // W."""
    windows = (n_tokens - 1) // seq_len
    g = np.arange(first, first + count, dtype=np.int64)
    epoch, pos = g // windows, g % windows
    out = np.empty(count, dtype=np.int64)
    for e in np.unique(epoch):
        here = epoch == e
        out[here] = permute(pos[here], windows, epoch_keys(seed, stream, int(e)))
    return out * seq_len
