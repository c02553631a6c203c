"""The one way a training feature plugs into the loop: `LoopHooks`, whose methods do nothing
(or pass through). Plain full-rank training runs with these defaults; low-rank training
(workbench.lowrank.controller) overrides them. The loop calls every hook unconditionally, so
the plain path and the hooked path are the same code.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from workbench.config import RunConfig
from workbench.train.engine import Engine
from workbench.train.optimizer import make_optimizer


class LoopHooks:
    """prepare -> make_optimizer -> (lr_factor, after_step)* -> finish; state_dict() rides in
    every checkpoint."""

    def prepare(self, ckpt: Any) -> None:
        """Before the optimizer exists (and before the checkpoint is loaded): `ckpt.peek(key)`
        reads what the newest checkpoint holds under one of this hook's state_dict keys."""

    def make_optimizer(self, engine: Engine, cfg: RunConfig) -> torch.optim.Optimizer:
        return make_optimizer(engine.parameters(), cfg, fused=engine.device.type == "cuda")

    def lr_factor(self, step: int) -> float:
        """Multiplies the schedule's learning rate at `step`."""
        return 1.0

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, lr: float
                   ) -> Tuple[torch.optim.Optimizer, Dict[str, float]]:
        """After optimizer.step() of `step`: the optimizer to use from now on, and metrics to
        log with this step."""
        return optimizer, {}

    def state_dict(self) -> Dict[str, Any]:
        """Entries added to every checkpoint (beside model, optimizer, RNG and step)."""
        return {}

    def finish(self) -> None:
        """After the last step (or a stop): write artifacts."""
