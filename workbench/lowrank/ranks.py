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
                 scales: dict[str, float], srs: dict[str, float],
                 total_params: float = 0.0) -> dict[str, int]:
    """The rank of every layer worth factorizing (others absent: they stay dense).
    Adaptive with `target_reduction` > 0 and the dense model's `total_params`: the ranks
    grown by grow_to_budget."""
    out: dict[str, int] = {}
    for s in layers:
        if mode == "fixed":
            r = fixed_rank(cfg.rank_ratio, s.out_features, s.in_features, cfg.round_to)
        else:
            r = adaptive_rank(scales[s.name], srs[s.name], s.out_features, s.in_features,
                              cfg.rank_lower_bound, cfg.round_to)
        if not no_gain(r, s.out_features, s.in_features):
            out[s.name] = r
    if mode == "adaptive" and cfg.target_reduction > 0 and total_params > 0:
        out = grow_to_budget(out, layers, total_params, cfg.target_reduction, cfg.round_to)
    return out


def _saved(ranks: dict[str, int], shapes: dict[str, LayerShape]) -> int:
    return sum(shapes[n].out_features * shapes[n].in_features
               - r * (shapes[n].out_features + shapes[n].in_features) for n, r in ranks.items())


def grow_to_budget(ranks: dict[str, int], layers: list[LayerShape], total_params: float,
                   target_reduction: float, multiple: int = 1) -> dict[str, int]:
    """Every rank times one factor f >= 1 (the largest that still saves `target_reduction`
    of `total_params`), so that the layers keep the proportions the stable ranks gave them.

    Why: the stable-rank rule says which layers need more rank than others, not how much
    rank the model can afford; it can save well past the goal (the README's low-rank section
    has a case), and the truncation at the switch is what the low-rank run pays for in loss. The
    extra rank keeps the next singular directions (more of each layer's energy) at a bytes
    cost the user sets. A rank stops at the largest that still saves parameters; a map that
    already misses the target is returned unchanged (never shrunk)."""
    shapes = {s.name: s for s in layers}
    need = target_reduction * total_params

    def at(f: float) -> dict[str, int]:
        out = {}
        for n, r in ranks.items():
            s = shapes[n]
            full = min(s.out_features, s.in_features)
            g = round_rank(min(full, max(r, math.ceil(f * r - 1e-9))), multiple, full)
            top = (s.out_features * s.in_features - 1) // (s.out_features + s.in_features)
            out[n] = max(r, min(g, top // max(1, multiple) * max(1, multiple)))
        return out

    if not ranks or _saved(ranks, shapes) < need:
        return dict(ranks)
    lo, hi = 1.0, max(min(shapes[n].out_features, shapes[n].in_features) / r
                      for n, r in ranks.items()) + 1.0
    for _ in range(50):  # saved(at(f)) falls as f grows: bisect for the last f that fits
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _saved(at(mid), shapes) >= need else (lo, mid)
    return at(lo)
