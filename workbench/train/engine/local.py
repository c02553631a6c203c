"""The single-process engine: the model on one device, gradient accumulation over micro-batches.

Parallel layouts get `parallel.ParallelEngine`; both satisfy the `Engine` protocol, so the
training loop never asks how the model is laid out.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from workbench.train.engine import Batch, autocast, local_peak_mem_bytes
from workbench.train.model import cross_entropy
from workbench.train.parallel.recompute import apply_block_steps


def named_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state keyed by parameter name, as multi-rank engines keep theirs: what
    a run started from this one loads in any layout (workbench.train.branch)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with warnings.catch_warnings():  # one process, no process group: as meant
        warnings.simplefilter("ignore")
        return get_optimizer_state_dict(model, optimizer)


class LocalEngine:
    """World size 1: plain forward/backward with gradient accumulation."""

    dp_rank, dp_size, is_main = 0, 1, True

    def __init__(self, model: nn.Module, device: torch.device, dtype: str = "fp32",
                 recompute: str = "none", compile_model: bool = False):
        self.device, self.dtype = device, dtype
        self.recompute, self.compile_model = recompute, compile_model
        self.rebuild(model)

    def rebuild(self, model: nn.Module) -> None:
        """Train `model` from now on, with the same recompute and compile steps."""
        self.model = model.to(self.device)
        apply_block_steps(self.model, self.recompute, self.compile_model)
        self.parts, self.view = [self.model], self.model

    def parameters(self) -> List[nn.Parameter]:
        return list(self.model.parameters())

    def train_step(self, micro_batches: List[Batch]) -> float:
        self.model.train()
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            with autocast(self.device, self.dtype):
                loss = cross_entropy(self.model(x), y) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        return float(total)

    @torch.no_grad()
    def eval_loss(self, batches: List[Batch]) -> float:
        self.model.eval()
        total = 0.0
        for x, y in batches:
            with autocast(self.device, self.dtype):
                total += float(cross_entropy(self.model(x), y))
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

    def named_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return named_optim_state(self.model, optimizer)

    def load_named_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                    state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        with warnings.catch_warnings():  # one process, no process group: as meant
            warnings.simplefilter("ignore")
            set_optimizer_state_dict(self.model, optimizer, state)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}

    # --- agreement and metrics: one rank agrees with itself and moves no bytes ---
    def step_stats(self, stop: bool) -> Tuple[Dict[str, float], bool]:
        return {"peak_mem_bytes": local_peak_mem_bytes(self.device)}, stop

    def uncounted(self) -> AbstractContextManager:
        return nullcontext()

    def gather_objects(self, obj: Any) -> List[Any]:
        return [obj]

    def from_rank0(self, obj: Any) -> Any:
        return obj
