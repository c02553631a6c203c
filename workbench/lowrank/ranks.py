"""Rank arithmetic for low-rank layers, torch-free so that the planner can use it.

Each layer's adaptive rank is its stable rank times a scale fixed at initialization (full rank
/ stable rank at step 0), so a layer whose stable rank did not move keeps its full rank, and one
that collapsed gets a proportionally small rank. A fixed rank is one ratio of min(m, n) for every
layer (Pufferfish). A layer whose factors would hold as many parameters as the dense layer stays
dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.config import LowRankConfig


def no_gain(rank: int, out_features: int, in_features: int) -> bool:
    """True when the factors hold at least as many parameters as the dense layer
    (r (m + n) >= m n): then factorizing costs FLOPs and bytes and saves nothing."""
    return rank * (out_features + in_features) >= out_features * in_features


def round_rank(rank: int, multiple: int, full: int) -> int:
    """Up to a multiple of `multiple` (matmul-friendly: 8 or 64 on GPUs), never past full."""
    if multiple > 1:
        rank = math.ceil(rank / multiple) * multiple
    return min(rank, full)


def adaptive_rank(scale: float, sr: float, out_features: int, in_features: int,
                  lower_bound: float, multiple: int = 1) -> int:
    """r = clip(ceil(scale * sr), ceil(lower_bound * min(m, n)), min(m, n)), then rounded."""
    full = min(out_features, in_features)
    floor = max(1, math.ceil(lower_bound * full))
    r = min(full, max(floor, math.ceil(scale * sr - 1e-9)))
    return round_rank(r, multiple, full)


def fixed_rank(ratio: float, out_features: int, in_features: int, multiple: int = 1) -> int:
    """Pufferfish-style: one ratio of min(m, n) for every factorized layer."""
    full = min(out_features, in_features)
    return round_rank(max(1, math.ceil(ratio * full)), multiple, full)


@dataclass(frozen=True)
class LayerShape:
    name: str
    out_features: int
    in_features: int


def rank_map_for(mode: str, cfg: LowRankConfig, layers: list[LayerShape],
                 scales: dict[str, float], srs: dict[str, float]) -> dict[str, int]:
    """The rank of every layer worth factorizing (others absent: they stay dense)."""
    out: dict[str, int] = {}
    for s in layers:
        if mode == "fixed":
            r = fixed_rank(cfg.rank_ratio, s.out_features, s.in_features, cfg.round_to)
        else:
            r = adaptive_rank(scales[s.name], srs[s.name], s.out_features, s.in_features,
                              cfg.rank_lower_bound, cfg.round_to)
        if not no_gain(r, s.out_features, s.in_features):
            out[s.name] = r
    return out
