"""The optimizer and its learning-rate schedule, shared by full-rank and low-rank training."""

from __future__ import annotations

import math
from typing import Collection, List

import torch

from workbench.config import RunConfig


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(params: List[torch.nn.Parameter], cfg: RunConfig, fused: bool = False,
                   no_decay: Collection[int] = ()) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms, biases and gains are not decayed).

    `no_decay` holds the ids of matrices that must not be decayed either (low-rank factors:
    the controller decays their product instead); they get a group of their own."""
    t = cfg.train
    live = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in live if p.dim() >= 2 and id(p) not in no_decay],
               "weight_decay": t.weight_decay},
              {"params": [p for p in live if p.dim() < 2], "weight_decay": 0.0},
              {"params": [p for p in live if p.dim() >= 2 and id(p) in no_decay],
               "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)
