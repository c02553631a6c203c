"""The training loop: one readable function, the same for every layout and launcher.

What differs between layouts (how a micro-batch is forwarded, how gradients are reduced) lives
in the engine (workbench.train.engine); the loop only sees `engine.train_step(micro_batches) ->
mean loss`. What a feature adds (low-rank training) comes through `LoopHooks`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from workbench.config import RunConfig
from workbench.data.corpus import TokenData
from workbench.layout import Layout
from workbench.startup import startup_done
from workbench.track.tracker import Tracker
from workbench.train import branch
from workbench.train.checkpoint.whole import CheckpointDir, rng_state, set_rng_state
from workbench.train.engine import Batch, Engine
from workbench.train.hooks import LoopHooks
from workbench.train.model import trainable_params
from workbench.train.optimizer import lr_at


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
    # What a feature adds to the loop (low-rank training: workbench.lowrank.controller); the
    # defaults do nothing.
    hooks: LoopHooks = field(default_factory=LoopHooks)
    run_dir: str = ""  # the run's folder (where a converted train.init_from checkpoint lies)


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


def resume(ctx: LoopContext, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer, RNG and data position from the newest whole checkpoint (or,
    before the run's first, from `train.init_from`); returns the first step to run."""
    # A sharded checkpoint loads in place, into the shapes of this layout: hence the template.
    found = ctx.ckpt.load_latest(template=lambda: {
        "model": ctx.engine.state_dict(), "optimizer": ctx.engine.optim_state_dict(optimizer)})
    if found is None:  # a new run: from scratch, or from another run's checkpoint
        init = ctx.cfg.train.init_from
        return branch.load(ctx.engine, optimizer, ctx.cfg, ctx.run_dir) if init else 0
    step, state = found
    ctx.engine.load_state_dict(state["model"])
    ctx.engine.load_optim_state_dict(optimizer, state["optimizer"])
    set_rng_state(state["rng"])
    if ctx.engine.is_main:
        print(f"resumed from checkpoint at step {step}", file=sys.stderr)
    return state["next_step"]


def save(ctx: LoopContext, optimizer: torch.optim.Optimizer, next_step: int) -> None:
    ctx.tracker.flush()  # metrics up to this step are recorded before the checkpoint exists
    state = {"model": ctx.engine.state_dict(),
             "optimizer": ctx.engine.optim_state_dict(optimizer),
             "rng": rng_state(), "next_step": next_step, "data_position": next_step,
             "layout": ctx.layout.key(), **ctx.hooks.state_dict()}
    ctx.ckpt.save(next_step, state)


def train(ctx: LoopContext) -> Dict[str, float]:
    """Run steps [resume point, train.steps); returns the last metrics."""
    cfg, t = ctx.cfg, ctx.cfg.train
    hooks = ctx.hooks
    hooks.prepare(ctx.ckpt)  # restores its state (factorized shapes) before the optimizer
    optimizer = hooks.make_optimizer(ctx.engine, cfg)
    startup_done()  # the optimizer imported torch._dynamo: the last big import
    start = resume(ctx, optimizer)
    trainable = float(trainable_params(ctx.engine.view))  # hooks report it anew if it changes
    # Per key, the last step already recorded by an earlier attempt of this run.
    logged = {k: ctx.tracker.last_logged_step(k) if start > 0 else -1
              for k in ("loss", "val_loss")}
    tokens_per_step = t.global_batch * cfg.model.seq_len
    last: Dict[str, float] = {}

    def log(metrics: Dict[str, float], step: int) -> None:
        # A resumed run recomputes steps after its checkpoint bitwise; skip those recorded.
        key = "val_loss" if "val_loss" in metrics and "loss" not in metrics else "loss"
        if step > logged[key]:
            ctx.tracker.log_metrics(metrics, step)

    for step in range(start, t.steps):
        if step % t.eval_every == 0:
            log(evaluate(ctx), step)
        lr = lr_at(step, cfg) * hooks.lr_factor(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        batch = micro_batches(ctx, "train", step, t.global_batch)
        loss = ctx.engine.train_step(batch)
        grad_norm = ctx.engine.clip_grad_norm(t.grad_clip) if t.grad_clip > 0 else 0.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.engine.device.type == "cuda":
            torch.cuda.synchronize()
        step_time_s = time.perf_counter() - t0
        tokens_per_s = tokens_per_step / step_time_s
        save_now = (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps
        # A stop signal is polled between checkpoints only (a checkpoint step saves anyway),
        # and agreed in the step's one metrics collective: every rank stops at the same step.
        stats, stop = ctx.engine.step_stats(
            not save_now and ctx.stop_requested is not None and ctx.stop_requested())
        last = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time_s,
                "tokens_per_s": tokens_per_s,
                "epochs": (step + 1) * tokens_per_step / ctx.data.train_tokens,
                "mfu": ctx.flops_per_token * tokens_per_s
                / (ctx.peak_flops_per_device * ctx.world_size),
                "params/trainable": trainable, **stats}
        optimizer, extra = hooks.after_step(step, optimizer, lr)
        last.update(extra)
        if step == start:  # startup cost as a user feels it: process start to first step done
            last["time_to_first_step_s"] = time.time() - _process_start_s()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower train.lr")
        if step % t.log_every == 0 or step == t.steps - 1:
            log(last, step)
        if ctx.on_step is not None:
            ctx.on_step(step, last)
        if save_now:
            if step + 1 == t.steps:
                vals = evaluate(ctx)
                last.update(vals)
                log(vals, step + 1)
            save(ctx, optimizer, step + 1)
        elif stop:
            save(ctx, optimizer, step + 1)
            last["stopped_at"] = step + 1
            break
    hooks.finish()
    ctx.tracker.flush()
    return last
