"""The training loop: `train` reads top to bottom, the same for every layout, world size and
launcher, and calls the steps below it in order.

What differs between layouts (how a micro-batch is forwarded, how gradients are reduced) lives
in the engine (workbench.train.engine); the loop only sees `engine.train_step(micro_batches) ->
mean loss`. What a feature adds (low-rank training) comes through `LoopHooks`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional

import torch

from workbench.config import RunConfig
from workbench.data.corpus import TokenData
from workbench.layout import Layout
from workbench.startup import startup_done
from workbench.track.tracker import Tracker
from workbench.train import branch
from workbench.train.checkpoint.folder import CheckpointDir, rng_state, set_rng_state
from workbench.train.engine import Batch, Engine
from workbench.train.hooks import LoopHooks
from workbench.train.model import trainable_params
from workbench.train.optimizer import lr_at, make_optimizer, update


def _process_start_s() -> float:
    import psutil

    return psutil.Process().create_time()


@dataclass
class LoopContext:
    cfg: RunConfig
    layout: Layout
    engine: Engine
    data: TokenData
    tracker: Tracker
    ckpt: CheckpointDir
    flops_per_token: float
    peak_flops_per_device: float
    world_size: int
    on_step: Optional[Callable[[int, Dict[str, float]], None]] = None  # progress bar
    # Polled after every step; True (a preemption or time-limit signal arrived) makes the loop
    # write a checkpoint and return early with last["stopped_at"] set, for a requeue to resume.
    stop_requested: Optional[Callable[[], bool]] = None
    # What a feature adds to the loop (low-rank training); the defaults do nothing.
    hooks: LoopHooks = field(default_factory=LoopHooks)
    run_dir: str = ""  # the run's folder (where a converted train.init_from checkpoint lies)


@dataclass
class Run:
    """What the loop carries from step to step."""

    optimizer: torch.optim.Optimizer
    start: int  # the first step this attempt runs
    trainable: float  # params/trainable, counted again when a hook changes the model
    logged: Dict[str, int]  # per key, the last step an earlier attempt already recorded


def micro_batches(ctx: LoopContext, split: str, step: int, count: int) -> List[Batch]:
    """This data-parallel rank's share of the step's global batch, as micro-batches."""
    seq = ctx.cfg.model.seq_len
    rows = ctx.data.offsets(ctx.cfg.train.seed, split, step, count, seq, ctx.cfg.data.order)
    share = count // ctx.engine.dp_size
    mine = rows[ctx.engine.dp_rank * share:(ctx.engine.dp_rank + 1) * share]
    mb = min(ctx.layout.micro_batch, share)
    out = []
    for i in range(0, share, mb):
        x, y = ctx.data.gather(split, mine[i:i + mb], seq)
        out.append((torch.from_numpy(x).to(ctx.engine.device),
                    torch.from_numpy(y).to(ctx.engine.device)))
    return out


def evaluate(ctx: LoopContext) -> Dict[str, float]:
    """Mean loss over a fixed set of validation sequences (the same at every evaluation), per
    source and for the target mixture when the data is a mixture (workbench.data.mixture)."""
    # Counted in global batches, which no layout changes, so every layout evaluates the same
    # sequences and runs that differ only in layout log comparable val_loss; the global batch
    # divides into whole micro-batches on every data-parallel rank.
    count = ctx.cfg.train.eval_batches * ctx.cfg.train.global_batch
    return ctx.data.val_losses(
        lambda split: ctx.engine.eval_loss(micro_batches(ctx, split, 0, count)))


def new_optimizer(ctx: LoopContext, no_decay: Collection[int] = ()) -> torch.optim.Optimizer:
    """AdamW over the engine's parameters (the hooks get this factory in their context)."""
    return make_optimizer(list(ctx.engine.view.parameters()), ctx.cfg,
                          fused=ctx.engine.device.type == "cuda", no_decay=no_decay)


def resume(ctx: LoopContext, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer, RNG and data position from the newest whole checkpoint (or,
    before the run's first, from `train.init_from`); returns the first step to run."""
    # DCP loads in place, into the shapes of this layout: hence the template.
    found = ctx.ckpt.load_latest(template=lambda: ctx.engine.state_dict(optimizer))
    if found is None:  # a new run: from scratch, or from another run's checkpoint
        init = ctx.cfg.train.init_from
        return branch.load(ctx.engine, optimizer, ctx.cfg, ctx.run_dir) if init else 0
    step, state = found
    ctx.engine.load_state_dict(state, optimizer)
    set_rng_state(state["rng"])
    if ctx.engine.is_main:
        print(f"resumed from checkpoint at step {step}", file=sys.stderr)
    return state["next_step"]


def save(ctx: LoopContext, optimizer: torch.optim.Optimizer, next_step: int) -> None:
    ctx.tracker.flush()  # metrics up to this step are recorded before the checkpoint exists
    state = {**ctx.engine.state_dict(optimizer), "rng": rng_state(), "next_step": next_step,
             "data_position": next_step, "layout": ctx.layout.key(), **ctx.hooks.state_dict()}
    ctx.ckpt.save(next_step, state)


def begin(ctx: LoopContext) -> Run:
    """The hooks restore their state (factorized shapes) before the optimizer exists; then
    the optimizer, and the model and optimizer state of a resumed or branched run."""
    ctx.hooks.prepare(ctx.ckpt)
    optimizer = new_optimizer(ctx, ctx.hooks.no_decay())
    startup_done()  # the optimizer imported torch._dynamo: the last big import
    start = resume(ctx, optimizer)
    logged = {k: ctx.tracker.last_logged_step(k) if start > 0 else -1
              for k in ("loss", "val_loss")}
    return Run(optimizer, start, float(trainable_params(ctx.engine.view)), logged)


def log(ctx: LoopContext, run: Run, metrics: Dict[str, float], step: int) -> None:
    """Record metrics, except those an earlier attempt of this run recorded: a resumed run
    recomputes the steps after its checkpoint bitwise."""
    key = "val_loss" if "val_loss" in metrics and "loss" not in metrics else "loss"
    if step > run.logged[key]:
        ctx.tracker.log_metrics(metrics, step)


def train_step(ctx: LoopContext, run: Run, step: int, lr: float) -> Dict[str, float]:
    """One global batch: forward/backward on every micro-batch, clip, optimizer step; with
    the step's throughput."""
    t = ctx.cfg.train
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    loss = ctx.engine.train_step(micro_batches(ctx, "train", step, t.global_batch))
    grad_norm = update(ctx.engine, run.optimizer, t.grad_clip)
    if ctx.engine.device.type == "cuda":
        torch.cuda.synchronize()
    step_time_s = time.perf_counter() - t0
    tokens_per_step = t.global_batch * ctx.cfg.model.seq_len
    tokens_per_s = tokens_per_step / step_time_s
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "epochs": (step + 1) * tokens_per_step / ctx.data.train_tokens,
            "mfu": ctx.flops_per_token * tokens_per_s
            / (ctx.peak_flops_per_device * ctx.world_size)}


def after_step(ctx: LoopContext, run: Run, step: int, lr: float,
               metrics: Dict[str, float]) -> None:
    """The hooks' turn: a new optimizer (the model changed) and their metrics."""
    optimizer, extra = ctx.hooks.after_step(step, run.optimizer, lr)
    if optimizer is not run.optimizer:
        run.optimizer, run.trainable = optimizer, float(trainable_params(ctx.engine.view))
    metrics["params/trainable"] = run.trainable
    metrics.update(extra)
    if step == run.start:  # startup cost as a user feels it: process start to first step done
        metrics["time_to_first_step_s"] = time.time() - _process_start_s()
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"loss is {metrics['loss']} at step {step}; lower train.lr")


def train(ctx: LoopContext) -> Dict[str, float]:
    """Run steps [resume point, train.steps); returns the last metrics."""
    t, hooks = ctx.cfg.train, ctx.hooks
    run = begin(ctx)
    last: Dict[str, float] = {}
    for step in range(run.start, t.steps):
        if step % t.eval_every == 0:
            log(ctx, run, evaluate(ctx), step)
        lr = lr_at(step, ctx.cfg) * hooks.lr_factor(step)
        last = train_step(ctx, run, step, lr)
        save_now = (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps
        # A stop signal is polled between checkpoints only (a checkpoint step saves anyway),
        # and agreed in the step's one metrics collective: every rank stops at the same step.
        stats, stop = ctx.engine.bookkeeping.step_stats(
            not save_now and ctx.stop_requested is not None and ctx.stop_requested())
        last.update(stats)
        after_step(ctx, run, step, lr, last)
        if step % t.log_every == 0 or step == t.steps - 1:
            log(ctx, run, last, step)
        if ctx.on_step is not None:
            ctx.on_step(step, last)
        if step + 1 == t.steps:  # the final evaluation, at the step the run ends on
            final = evaluate(ctx)
            last.update(final)
            log(ctx, run, final, step + 1)
        if save_now or stop:
            save(ctx, run.optimizer, step + 1)
        if stop:
            last["stopped_at"] = step + 1
            break
    hooks.finish()
    ctx.tracker.flush()
    return last
