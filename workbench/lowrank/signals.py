"""The per-layer signals a switch can be decided on, measured at every check and all logged, so
that the choice of signal can be audited on a real run (MLflow `lowrank/*`, the signals plot).

- `sr`: stable rank ||W||_F^2 / sigma_max^2 (warm-started power iteration, factorize.py).
- `rank`: the integer rank the layer would get if the switch happened now (scale at init x
  stable rank, clipped and rounded to `round_to`): what the switch actually uses (Cuttlefish).
- `energy_rank`: how many singular directions hold `energy` of the squared Frobenius norm of
  the learned update W - W0 (InRank's explained-variance rank); W0 is rebuilt from the seed.
- `overlap`: ||B_prev^T B_now||_F^2 / k of the top-k right singular subspaces of W at this
  and the previous check (k = the current rank): 1 when the subspace did not move (Q-GaLore).

Levels handed to the detector are in % of the layer's full rank min(m, n) (`subspace`: the
cumulative subspace travel, sum of sqrt(1 - overlap), in %), so one threshold fits every layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workbench.lowrank.ranks import adaptive_rank

SIGNALS = ("rank", "stable_rank", "energy_rank", "subspace")


def _gram(w: torch.Tensor) -> torch.Tensor:
    """W^T W or W W^T, whichever is smaller: its eigenpairs are W's squared singular values
    and singular vectors of the smaller side, at a fraction of an SVD's cost (in float32: an
    energy share of 0.9 and a top-k subspace need no more)."""
    return w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T


def energy_rank(delta: torch.Tensor, energy: float) -> int:
    """The fewest singular directions holding `energy` of ||delta||_F^2 (0 for delta = 0)."""
    ev = torch.linalg.eigvalsh(_gram(delta.float())).double().flip(0).clamp_min(0)
    total = float(ev.sum())
    if total <= 0:
        return 0
    cum = torch.cumsum(ev, 0) / total
    return int(torch.searchsorted(cum, torch.tensor([energy - 1e-12], dtype=cum.dtype))) + 1


def top_basis(w: torch.Tensor, k: int) -> torch.Tensor:
    """An orthonormal basis of W's top-k singular subspace on its smaller side (float32)."""
    _, vecs = torch.linalg.eigh(_gram(w.float()))
    return vecs.flip(1)[:, :max(1, k)].contiguous()


def overlap(prev: torch.Tensor, now: torch.Tensor) -> float:
    """||P^T Q||_F^2 / k over the first k = min(k_prev, k_now) columns: the mean squared
    cosine of the principal angles between the two top-k subspaces."""
    k = min(prev.shape[1], now.shape[1])
    return float((prev[:, :k].double().T @ now[:, :k].double()).pow(2).sum()) / k


class LayerSignals:
    """One layer's signal state between checks: its initial weight, last top-k basis and
    cumulative subspace travel (the stable-rank probe stays with measure.py)."""

    def __init__(self, w0: torch.Tensor):
        self.w0 = w0.detach().to("cpu", torch.float32).clone()
        self.basis: torch.Tensor | None = None
        self.travel = 0.0

    def measure(self, w: torch.Tensor, sr: float, scale: float, lower_bound: float,
                round_to: int, energy: float) -> dict[str, float]:
        w = w.detach().to("cpu", torch.float32)
        m, n = w.shape
        full = min(m, n)
        rank = adaptive_rank(scale, sr, m, n, lower_bound, round_to)
        basis = top_basis(w, rank)
        ov = 1.0 if self.basis is None else overlap(self.basis, basis)
        self.basis = basis
        self.travel += math.sqrt(max(0.0, 1.0 - ov))
        return {"sr": sr, "rank": float(rank),
                "energy_rank": float(energy_rank(w - self.w0, energy)), "overlap": ov,
                "full": float(full), "travel": self.travel}

    def state_dict(self) -> dict[str, Any]:
        return {"basis": None if self.basis is None else self.basis.clone(), "travel": self.travel}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.basis = None if state["basis"] is None else state["basis"].clone()
        self.travel = float(state["travel"])


def level(signal: str, s: dict[str, float], scale: float) -> float:
    """The detector's level for `signal` from one layer's measurement, in % of full rank."""
    if signal == "rank":
        return 100.0 * s["rank"] / s["full"]
    if signal == "stable_rank":
        return 100.0 * min(1.0, scale * s["sr"] / s["full"])
    if signal == "energy_rank":
        return 100.0 * s["energy_rank"] / s["full"]
    return 100.0 * s["travel"]
