"""The single-process engine: the model on one device, gradient accumulation over micro-batches.

Parallel layouts get their engine from `parallelize.py`; both satisfy `loop.Engine`, so the
training loop never asks how the model is laid out.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.train.loop import Batch, cpu_peak_rss_bytes
from workbench.train.model import Transformer, cross_entropy


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation checkpointing: `full` recomputes every block in backward; `selective`
    recomputes every other block (odd global index, so pipeline stages agree), halving
    activation memory for half the recompute. With fused attention there is no s*s tensor for
    Korthikanti's attention-core recompute to drop, so selective means this (torchtitan's layer
    policy with frequency 2), and the cost model (plan/terms.py) models exactly this."""
    if mode == "none":
        return
    for key, block in model.layers.items():
        if mode == "full" or int(key) % 2 == 1:
            block.forward = _checkpointed(block.forward)


def _checkpointed(fn):
    def wrapper(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapper


def autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


class LocalEngine:
    """World size 1: plain forward/backward with gradient accumulation."""

    dp_rank, dp_size, is_main = 0, 1, True

    def __init__(self, model: Transformer, device: torch.device, dtype: str = "fp32",
                 recompute: str = "none", compile_model: bool = False):
        self.model, self.device, self.dtype = model, device, dtype
        apply_recompute(model, recompute)
        self.forward: nn.Module = torch.compile(model) if compile_model else model

    def parameters(self) -> List[nn.Parameter]:
        return list(self.model.parameters())

    def train_step(self, micro_batches: List[Batch]) -> float:
        self.model.train()
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            with autocast(self.device, self.dtype):
                loss = cross_entropy(self.forward(x), y) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        return float(total)

    @torch.no_grad()
    def eval_loss(self, batches: List[Batch]) -> float:
        self.model.eval()
        total = 0.0
        for x, y in batches:
            with autocast(self.device, self.dtype):
                total += float(cross_entropy(self.forward(x), y))
        return total / len(batches)

    def clip_grad_norm(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def state_dict(self) -> Dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return optimizer.state_dict()

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                              state: Dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def any_rank(self, flag: bool) -> bool:
        return flag

    def comm_bytes(self) -> Dict[str, float]:
        return {}

    def peak_mem_bytes(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return cpu_peak_rss_bytes()
