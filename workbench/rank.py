"""The rank entry with the training features a run's config asks for.

`run_job` is `workbench.train.main.run_job` with the loop hooks of `lowrank.mode`, chosen here,
once: above both packages, so that `workbench.train` never imports `workbench.lowrank` and
`workbench.lowrank` imports only the hook interface of `workbench.train`. Every launcher and
`python -m workbench.train` end here.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from workbench.job import Job
from workbench.lowrank.cuttlefish import AdaptiveSwitch, Cuttlefish, FixedSwitch
from workbench.lowrank.powersgd import PowerSGDHooks
from workbench.train import main
from workbench.train.hooks import HookContext, LoopHooks


def hooks_for(ctx: HookContext) -> LoopHooks:
    """The loop hooks for `lowrank.mode`: none (the defaults) when it is off; Cuttlefish's
    rank switch at a fixed share of training or when the layers' ranks settle; PowerSGD's
    gradient compression."""
    mode = ctx.cfg.lowrank.mode
    if mode == "powersgd":
        return PowerSGDHooks(ctx)
    if mode == "adaptive":
        return Cuttlefish(ctx, AdaptiveSwitch(ctx.cfg))
    if mode == "fixed":
        return Cuttlefish(ctx, FixedSwitch(ctx.cfg))
    return LoopHooks()


def run_job(job: Job, progress: bool = True,
            stop_requested: Optional[Callable[[], bool]] = None) -> Dict[str, float]:
    """Train the job on this rank (main.run_job) with the hooks its config asks for."""
    return main.run_job(job, hooks_for, progress, stop_requested)
