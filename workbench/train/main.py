"""What every rank runs: `run_job` (called by `python -m workbench.train JOB_FILE`).

Every launcher (local, torchrun, Slurm) ends here with the same job file; the code below never
knows how it was started. World size and rank come from the environment torchrun or Slurm set.
A world of one rank is a process group of one (in memory, no network): one engine, one kind of
checkpoint. The loop hooks a run gets come from the caller (`hooks_for`), chosen above this
package by what the config asks for (workbench/rank.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from functools import partial
from typing import Callable, Dict, Optional

import torch

from workbench.config import compute_dtype
from workbench.data.corpus import open_tokens
from workbench.job import FINAL_METRICS, Job
from workbench.track.tracker import make_tracker
from workbench.train import loop
from workbench.train.checkpoint.folder import CheckpointDir
from workbench.train.checkpoint.legacy import refuse_resume
from workbench.train.checkpoint.names import layout_folder
from workbench.train.engine.mesh_engine import MeshEngine, make_engine
from workbench.train.hooks import HookContext, HooksFor, no_hooks
from workbench.train.model import build, flops_per_token
from workbench.train.parallel import comm


def peak_flops(cfg) -> float:
    c = cfg.cluster
    if c.device == "cpu":
        return c.peak_fp32_flops
    return c.peak_bf16_flops if compute_dtype(cfg.train, c) == "bf16" else c.peak_fp32_flops


def world_from_env() -> Dict[str, int]:
    env = os.environ
    return {"rank": int(env.get("RANK", env.get("SLURM_PROCID", 0))),
            "world_size": int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1))),
            "local_rank": int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))}


def run_job(job: Job, hooks_for: HooksFor = no_hooks, progress: bool = True,
            stop_requested: Optional[Callable[[], bool]] = None) -> Dict[str, float]:
    """Train the job to its last step (resuming if it has checkpoints); returns final metrics.
    `stop_requested` (polled each step; the Slurm launcher's preemption flag) makes the loop
    checkpoint and return early with last["stopped_at"], for a requeue to resume."""
    cfg = job.run_config()
    refuse_resume(job.run_dir)  # before the tracker: a refused run's record stays as it was
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    world = world_from_env()
    if world["world_size"] != job.world_size:
        raise RuntimeError(f"job expects world size {job.world_size}, got {world['world_size']}")
    if cfg.cluster.device == "cuda":
        torch.cuda.set_device(world["local_rank"])
    counter = comm.ByteCounter()  # what the process group counts into, and the engine reads
    # The default group lives exactly as long as training. The engine's parallelized model holds
    # the group in reference cycles: collected after the group's end (at the interpreter's exit)
    # it aborted a rank now and then ("terminate called without an active exception"; seen on
    # the two-node cluster at the end of a finished run), so it is collected while the group lives.
    with comm.process_group(cfg.cluster.device, world["rank"], world["world_size"], counter):
        try:
            return _train(job, cfg, world, counter, hooks_for, progress, stop_requested)
        finally:
            gc.collect()


def _engine(job: Job, cfg, world: Dict[str, int], counter: comm.ByteCounter) -> MeshEngine:
    device = torch.device("cuda", world["local_rank"]) if cfg.cluster.device == "cuda" \
        else torch.device("cpu")
    return make_engine(build(cfg.model, cfg.train.seed, device), cfg, job.the_layout(),
                       world["rank"], device, counter)


def _end(tracker) -> None:
    """Close the run as the exception being handled ends it: KILLED on Ctrl-C, else FAILED."""
    tracker.close("KILLED" if isinstance(sys.exc_info()[1], KeyboardInterrupt) else "FAILED")


def _train(job: Job, cfg, world: Dict[str, int], counter: comm.ByteCounter,
           hooks_for: HooksFor, progress: bool,
           stop_requested: Optional[Callable[[], bool]]) -> Dict[str, float]:
    try:
        engine = _engine(job, cfg, world, counter)
    except BaseException:  # building the model (out of memory, say) fails the run, as a step
        if world["rank"] == 0:  # would; rank 0 speaks for ranks that fail alike
            _end(make_tracker(cfg.tracking, job.run_id, owns_metrics=True))
        raise
    tracker = make_tracker(cfg.tracking, job.run_id, owns_metrics=engine.is_main)
    bar = _progress(cfg.train.steps) if progress and engine.is_main else None
    try:
        ctx = loop.LoopContext(
            cfg=cfg, layout=job.the_layout(), engine=engine, data=open_tokens(job.data_dir),
            tracker=tracker, flops_per_token=flops_per_token(cfg.model),
            ckpt=CheckpointDir(layout_folder(job.run_dir, job.layout), engine.bookkeeping,
                               cfg.train.keep_ckpts, cfg.train.keep_every),
            peak_flops_per_device=peak_flops(cfg), world_size=job.world_size,
            on_step=bar.on_step if bar else None, stop_requested=stop_requested,
            run_dir=job.run_dir)
        ctx.hooks = hooks_for(hook_context(ctx, tracker, job.run_dir))
        last = loop.train(ctx)
    except BaseException:
        _end(tracker)
        raise
    finally:
        if bar:
            bar.close()
    # A run stopped for a requeue stays RUNNING: its next attempt continues the same MLflow run.
    tracker.close("RUNNING" if "stopped_at" in last else "FINISHED")
    if engine.is_main:  # a launcher that started the ranks as processes reads it back
        path = os.path.join(job.run_dir, FINAL_METRICS)
        with open(path + ".tmp", "w") as f:
            json.dump(last, f)
        os.replace(path + ".tmp", path)
    return last


def hook_context(ctx: loop.LoopContext, tracker, run_dir: str) -> HookContext:
    """What the loop's hooks get of training: the engine, and how to build a model and an
    optimizer as the loop does."""
    cfg = ctx.cfg
    return HookContext(cfg=cfg, engine=ctx.engine, tracker=tracker, run_dir=run_dir,
                       build_model=partial(build, cfg.model, cfg.train.seed, "cpu"),
                       make_optimizer=partial(loop.new_optimizer, ctx))


class _progress:
    """A tqdm bar with loss and tokens/s (stderr, so stdout stays machine-readable)."""

    def __init__(self, total: int):
        self.total, self.bar = total, None

    def on_step(self, step: int, m: Dict[str, float]) -> None:
        if self.bar is None:  # created at the first step: a run that fails early prints one line
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=step, desc="train", unit="step",
                            file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
