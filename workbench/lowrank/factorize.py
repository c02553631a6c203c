"""Low-rank factorized linear layers: factorizing, measuring, converting and sharding them.

A trained `nn.Linear` W (out x in) becomes x -> V x -> U (V x) with U = U_r sqrt(S_r) and
V = sqrt(S_r) V_r^T from a truncated SVD: at full rank the product is W itself, and splitting
sqrt(S) evenly keeps both factors on the same scale, which is what Adam and weight decay expect.

Ranks follow the stable rank ||W||_F^2 / sigma_max^2, a smooth, cheap proxy of how many
directions a layer actually uses (Cuttlefish, Wang et al. 2023). sigma_max comes from a few
power iterations warm-started from the previous check, so a check costs a few matrix-vector
products instead of an SVD. How a stable rank becomes a rank is torch-free arithmetic shared
with the planner (ranks.py); when to switch lives in detector.py and cuttlefish.py.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from workbench.config import LowRankConfig
from workbench.errors import ConfigError
from workbench.lowrank.ranks import LayerShape

# Linear layers of a block that may be factorized; the tensor-parallel style of each base
# layer decides how its factors are sharded (LowRankLinear.tp_plan).
_CANDIDATE = re.compile(r"^layers\.(\d+)\.(attention\.w[qkvo]|feed_forward\.w[123])$")
COLD_ITERS = 30  # power iterations of a probe's first estimate (no previous vector to start from)


class LowRankLinear(nn.Module):
    """y = U (V x) + b at rank r: two linears, `v` (in -> r, no bias) then `u` (r -> out).

    The bias sits on the second factor so that a converted layer computes exactly what the
    full one did; `u`/`v` are plain nn.Linear so that tensor-parallel styles, FSDP and
    optimizers treat them like any other linear."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.v = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.u = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}"

    @torch.no_grad()
    def product(self) -> torch.Tensor:
        """U V, the dense weight this layer represents (out x in)."""
        return self.u.weight @ self.v.weight

    def tp_plan(self, base_style: object, sequence_parallel: bool) -> dict[str, object]:
        """Tensor-parallel styles for the factors, consistent with `base_style`, the plan of
        the dense layer this one replaced (parallelize asks every module that has this method):

        - column-wise base (output split over tp): `u` column-wise (its output dim sharded),
          `v` replicated; the all-reduce of the r-wide activation gradient replaces the one
          the base layer's input would have needed.
        - row-wise base (input split): `v` row-wise (its input dim sharded, the r-wide partial
          sum all-reduced: cheaper than the base's out-wide one), `u` replicated."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            raise ConfigError("layout.sequence_parallel", True, "low-rank layers under tensor "
                              "parallelism support sequence_parallel=false only (the "
                              "replicated factor would need SP-aware gradients)")
        if isinstance(base_style, ColwiseParallel):
            return {"u": ColwiseParallel(input_layouts=Replicate())}
        if isinstance(base_style, RowwiseParallel):
            return {"v": RowwiseParallel(output_layouts=Replicate())}
        raise ValueError(f"no factor plan for a base style {type(base_style).__name__}")


@torch.no_grad()
def factorize(linear: nn.Linear, rank: int) -> LowRankLinear:
    """The rank-`rank` truncated-SVD factorization of a trained linear (exact at full rank).

    The SVD runs in float64 so that conversion error is the truncation alone, then the factors
    are cast back to the layer's dtype."""
    w = linear.weight.detach()
    out_f, in_f = w.shape
    rank = max(1, min(rank, out_f, in_f))
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    root = s[:rank].sqrt()
    layer = LowRankLinear(in_f, out_f, rank, linear.bias is not None, device=w.device,
                          dtype=w.dtype)
    layer.u.weight.copy_((u[:, :rank] * root).to(w.dtype))
    layer.v.weight.copy_((root[:, None] * vh[:rank]).to(w.dtype))
    if linear.bias is not None:
        layer.u.bias.copy_(linear.bias.detach())
    return layer


def stable_rank(weight: torch.Tensor) -> float:
    """Exact stable rank ||W||_F^2 / sigma_max^2 (a full SVD: for tests and references)."""
    w = weight.detach().double()
    sigma = torch.linalg.matrix_norm(w, ord=2)
    return float(w.pow(2).sum() / sigma.pow(2))


class StableRankProbe:
    """Stable rank of one weight by warm-started power iteration on W^T W.

    The right singular vector estimate is kept between checks: weights move little in
    `check_every` steps, so two iterations from last time's vector track sigma_max closely,
    where a cold start would need dozens. The start vector comes from its own seeded
    generator, so the estimate never touches the global RNG (bitwise-reproducible runs)."""

    def __init__(self, n_in: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(n_in, generator=g, dtype=torch.float64)
        self.v = v / v.norm()
        self.warm = False

    @torch.no_grad()
    def __call__(self, weight: torch.Tensor, iters: int) -> float:
        """The estimate; the first call (cold start) iterates `COLD_ITERS` times at least."""
        w = weight.detach().to("cpu", torch.float64)
        v = self.v
        for _ in range(max(1, iters if self.warm else max(iters, COLD_ITERS))):
            v = w.T @ (w @ v)
            norm = v.norm()
            if norm == 0:
                return 0.0
            v = v / norm
        self.v, self.warm = v, True
        sigma_sq = float((w @ v).pow(2).sum())
        return float(w.pow(2).sum()) / sigma_sq if sigma_sq > 0 else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"v": self.v.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.v, self.warm = state["v"].to(torch.float64).clone(), True


def candidates(model: nn.Module, cfg: LowRankConfig, n_layers: int) -> list[tuple[str, nn.Linear]]:
    """The linears that may be factorized, by global name: those of the blocks between the
    first `keep_first_blocks` and the last `keep_last_blocks`. Embeddings, the LM head and
    norms never are: they are small, or (the head) sensitive and tied to the embedding."""
    out = []
    for name, module in model.named_modules():
        m = _CANDIDATE.match(name)
        if m is None or not isinstance(module, nn.Linear):
            continue
        block = int(m.group(1))
        if block < cfg.keep_first_blocks or block >= n_layers - cfg.keep_last_blocks:
            continue
        out.append((name, module))
    return out


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def convert(model: nn.Module, rank_map: dict[str, int]) -> list[str]:
    """Factorize, in place, each linear named in `rank_map` at its rank; returns the names
    converted (layers already low-rank are left as they are)."""
    done = []
    for name, rank in sorted(rank_map.items()):
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            replace(model, name, factorize(module, rank))
            done.append(name)
    return done


def factor_params(model: nn.Module) -> list[nn.Parameter]:
    """The weights of every low-rank factor (they get Frobenius decay, not weight decay)."""
    return [p for m in model.modules() if isinstance(m, LowRankLinear)
            for p in (m.u.weight, m.v.weight)]


@torch.no_grad()
def frobenius_decay(model: nn.Module, coef: float) -> None:
    """Decoupled decay of ||U V||_F^2 / 2 on every factorized layer: U -= coef (U V) V^T,
    V -= coef U^T (U V).

    Weight decay on each factor would shrink U and V separately and push the pair to
    unbalanced scales; decaying their product regularizes the function the layer computes,
    as weight decay did on the dense layer (Pufferfish/Cuttlefish)."""
    if coef == 0:
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    for m in model.modules():
        if not isinstance(m, LowRankLinear):
            continue
        u, v = full_weight(m.u.weight), full_weight(m.v.weight)
        w = u @ v
        du, dv = coef * (w @ v.T), coef * (u.T @ w)
        for p, d in ((m.u.weight, du), (m.v.weight, dv)):
            if isinstance(p, DTensor):
                p.sub_(distribute_tensor(d, p.device_mesh, p.placements, src_data_rank=None))
            else:
                p.sub_(d)


def shapes(pairs: list[tuple[str, nn.Linear]]) -> list[LayerShape]:
    return [LayerShape(n, m.out_features, m.in_features) for n, m in pairs]


def make_probes(layers: list[LayerShape], seed: int) -> dict[str, StableRankProbe]:
    return {s.name: StableRankProbe(s.in_features, seed * 7919 + i)
            for i, s in enumerate(layers)}


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a possibly sharded (DTensor) weight; a collective when sharded,
    so every rank must call it in the same order."""
    from torch.distributed.tensor import DTensor

    return weight.full_tensor() if isinstance(weight, DTensor) else weight
