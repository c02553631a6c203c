"""The one way a training feature plugs into the loop: `LoopHooks`, whose methods do nothing
(or pass through), and the `HookContext` a feature's hooks are built with.

Plain full-rank training runs with the defaults; a feature (low-rank training, workbench.lowrank)
overrides them. The loop calls every hook unconditionally, so the plain path and the hooked path
are the same code. A feature imports this module and nothing else of workbench.train: what it
needs of training (the engine, a model builder, an optimizer factory) comes in the context,
and which hooks a run gets is chosen above both packages (workbench/rank.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Tuple

import torch
from torch import nn

from workbench.config import RunConfig
from workbench.train.checkpoint.folder import CheckpointDir
from workbench.train.engine import Engine


@dataclass
class HookContext:
    """What a feature's hooks may use, handed to them when the rank starts."""

    cfg: RunConfig
    engine: Engine
    tracker: Any  # workbench.track.tracker.Tracker: metrics and artifacts (rank 0 records)
    run_dir: str  # where the run's artifacts go ('' for runs without a folder)
    build_model: Callable[[], nn.Module]  # the full model with its seeded initial weights, CPU
    # AdamW over the engine's parameters as the loop builds it; the ids in its argument get no
    # weight decay
    make_optimizer: Callable[[Collection[int]], torch.optim.Optimizer]


class LoopHooks:
    """prepare -> no_decay -> (lr_factor, after_step)* -> finish; state_dict() rides in every
    checkpoint."""

    def prepare(self, ckpt: CheckpointDir) -> None:
        """Before the optimizer exists (and before the checkpoint is loaded): `ckpt.peek(key)`
        reads what the newest checkpoint holds under one of this hook's state_dict keys."""

    def no_decay(self) -> Collection[int]:
        """Ids of matrices the optimizer must not weight-decay (the hook regularizes them its
        own way)."""
        return ()

    def lr_factor(self, step: int) -> float:
        """Multiplies the schedule's learning rate at `step`."""
        return 1.0

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, lr: float
                   ) -> Tuple[torch.optim.Optimizer, Dict[str, float]]:
        """After optimizer.step() of `step`: the optimizer to use from now on (a new one means
        the model changed), and metrics to log with this step."""
        return optimizer, {}

    def state_dict(self) -> Dict[str, Any]:
        """Entries added to every checkpoint (beside model, optimizer, RNG and step)."""
        return {}

    def finish(self) -> None:
        """After the last step (or a stop): write artifacts."""


HooksFor = Callable[[HookContext], LoopHooks]  # a run's hooks, chosen from its context


def no_hooks(ctx: HookContext) -> LoopHooks:
    return LoopHooks()
