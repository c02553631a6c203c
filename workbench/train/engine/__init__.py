"""The Engine protocol: what the training loop and the loop hooks need from a (possibly
parallel) model, whatever its layout.

Two engines satisfy it: `local.LocalEngine` (one process) and `parallel.ParallelEngine` (a
parallelized model over a named mesh). The loop and the low-rank controller only ever see this
protocol, so they never ask how the model is laid out. This module imports neither engine.
"""

from __future__ import annotations

import resource
from contextlib import AbstractContextManager
from typing import Any, Dict, List, Protocol, Tuple

import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]


class Engine(Protocol):
    """A model laid out over this rank's devices, trained one global batch per step."""

    device: torch.device
    dp_rank: int
    dp_size: int
    is_main: bool  # this rank logs metrics and prints
    parts: List[nn.Module]  # the modules this rank runs, as wrapped (DDP) or not
    view: nn.Module  # this rank's model under its global parameter names

    def parameters(self) -> List[nn.Parameter]: ...
    def train_step(self, micro_batches: List[Batch]) -> float: ...
    def eval_loss(self, batches: List[Batch]) -> float: ...
    def clip_grad_norm(self, max_norm: float) -> float: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    # The optimizer's state through the engine: multi-rank engines key it by parameter name
    # (torch.distributed.checkpoint), so a checkpoint loads into another layout.
    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]: ...
    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                              state: Dict[str, Any]) -> None: ...
    # The same keyed by parameter name in every engine (the multi-rank ones' own form): what
    # a run started from another one's checkpoint loads (workbench.train.branch).
    def named_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]: ...
    def load_named_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                    state: Dict[str, Any]) -> None: ...
    # Every parameter and buffer this rank holds, whole and on the CPU (a collective).
    def full_state_dict(self) -> Dict[str, torch.Tensor]: ...
    # The same layout, devices and mesh around a new full model (a factorized one, say).
    def rebuild(self, model: nn.Module) -> None: ...
    # Once per step: this step's metrics (peak memory, communication) and whether any rank
    # asked to stop, agreed in one collective so that every rank stops at the same step.
    def step_stats(self, stop: bool) -> Tuple[Dict[str, float], bool]: ...
    # Bookkeeping collectives that are not the model's traffic (left out of comm/* metrics).
    def uncounted(self) -> AbstractContextManager: ...
    def gather_objects(self, obj: Any) -> List[Any]: ...  # every rank's, in rank order
    def from_rank0(self, obj: Any) -> Any: ...  # rank 0's value on every rank


def cpu_peak_rss_bytes() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def local_peak_mem_bytes(device: torch.device) -> float:
    """This rank's peak memory: allocated on its GPU, resident on the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return cpu_peak_rss_bytes()


def autocast(device: torch.device, dtype: str) -> AbstractContextManager:
    """bf16 autocast when the run computes in bf16 (and parameters stay fp32 masters)."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)
