"""The Engine protocol: what the training loop and the loop hooks need from a model laid out
over this rank's devices, whatever the layout and the world size.

One class satisfies it (`mesh_engine.MeshEngine`, for a mesh of any size, one rank included),
but the loop and the hooks only ever see this protocol, so they never ask how the model is laid
out. This module imports no engine.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from workbench.train.engine.bookkeeping import Bookkeeping

Batch = Tuple[torch.Tensor, torch.Tensor]


class Engine(Protocol):
    """A model laid out over this rank's devices, trained one global batch per step."""

    device: torch.device
    dp_rank: int  # which slice of the global batch this rank reads
    dp_size: int
    is_main: bool  # this rank logs metrics and prints
    view: nn.Module  # this rank's model under its global parameter names
    bookkeeping: Bookkeeping  # uncounted collectives: step stats, gather, broadcast

    def train_step(self, micro_batches: List[Batch]) -> float: ...
    def eval_loss(self, batches: List[Batch]) -> float: ...
    def clip_grad_norm(self, max_norm: float) -> float: ...
    # {"model": ..., "optimizer": ...} keyed by parameter name (torch.distributed.checkpoint),
    # so a checkpoint written in one layout or world size loads into another.
    def state_dict(self, optimizer: Optional[torch.optim.Optimizer] = None
                   ) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any],
                        optimizer: Optional[torch.optim.Optimizer] = None) -> None: ...
    # Every parameter and buffer this rank holds, whole and on the CPU (a collective).
    def full_state_dict(self) -> Dict[str, torch.Tensor]: ...
    # The same layout, devices and mesh around a new full model (a factorized one, say).
    def rebuild(self, model: nn.Module) -> None: ...
    # A DDP-style gradient communication hook on every replicated module, registered before
    # the first forward; `make_state(module, group)` builds each one's state, returned.
    def register_comm_hook(self, make_state: Callable[[nn.Module, Any], Any],
                           hook: Callable) -> List[Any]: ...
