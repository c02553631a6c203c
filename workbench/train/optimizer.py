"""The optimizer and its learning-rate schedule, shared by full-rank and low-rank training."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Collection, List

import torch

from workbench.config import RunConfig, TrainConfig

if TYPE_CHECKING:
    from workbench.train.engine import Engine


def decay_steps(t: TrainConfig) -> int:
    """The steps of a `wsd` schedule's final decay: as set, or 20% of the run, the share at
    which Hägele et al. (2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
    Durations", Fig. 4) find a 1-sqrt cool-down matches a cosine schedule of the same length."""
    return t.decay_steps or max(1, round(0.2 * t.steps))


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then `train.lr_schedule`:

    - cosine: decay to min_lr_ratio * lr at the last step;
    - wsd (warm-up, stable, decay): lr until the last `decay_steps`, then a 1-sqrt decay to the
      floor. The stable phase does not depend on the run's length, so a constant-rate run can be
      continued, or branched off into cool-downs (`train.init_from`), at any of its checkpoints;
    - constant: lr after the warm-up (a long run to branch cool-downs from).
    """
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    floor = t.lr * t.min_lr_ratio
    if t.lr_schedule == "constant":
        return t.lr
    if t.lr_schedule == "wsd":
        start = t.steps - decay_steps(t)
        if step < start:
            return t.lr
        progress = min(1.0, (step - start + 1) / (t.steps - start))
        return floor + (t.lr - floor) * (1.0 - math.sqrt(progress))
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(params: List[torch.nn.Parameter], cfg: RunConfig, fused: bool = False,
                   no_decay: Collection[int] = ()) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms, biases and gains are not decayed).

    `no_decay` holds the ids of matrices that must not be decayed either (low-rank factors:
    the low-rank hooks decay their product instead); they get a group of their own."""
    t = cfg.train
    live = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in live if p.dim() >= 2 and id(p) not in no_decay],
               "weight_decay": t.weight_decay},
              {"params": [p for p in live if p.dim() < 2], "weight_decay": 0.0},
              {"params": [p for p in live if p.dim() >= 2 and id(p) in no_decay],
               "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)


def update(engine: Engine, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """The update after a step's gradients, one sequence for the loop and the profiler's probes
    (which price it as the loop pays it): clip over the engine's shards and stages, the
    optimizer's step, gradients set to None (the next backward allocates them afresh). Returns
    the gradient norm before clipping (0 without clipping)."""
    grad_norm = engine.clip_grad_norm(grad_clip) if grad_clip > 0 else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
