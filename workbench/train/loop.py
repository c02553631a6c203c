"""The training loop: one readable function, the same for every layout and launcher.

What differs between layouts (how a micro-batch is forwarded, how gradients are reduced) lives
in the engine; the loop only sees `engine.train_step(micro_batches) -> mean loss`.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from workbench.config import RunConfig
from workbench.data.corpus import TokenData
from workbench.layout import Layout
from workbench.track.tracker import Tracker
from workbench.train.checkpoint import CheckpointDir, rng_state, set_rng_state

Batch = Tuple[torch.Tensor, torch.Tensor]


class Engine(Protocol):
    """What the loop needs from a (possibly parallel) model."""

    device: torch.device
    dp_rank: int
    dp_size: int
    is_main: bool  # this rank logs metrics and prints

    def parameters(self) -> List[torch.nn.Parameter]: ...
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
    def any_rank(self, flag: bool) -> bool: ...  # True everywhere if true on one rank
    def comm_bytes(self) -> Dict[str, float]: ...
    def peak_mem_bytes(self) -> float: ...


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = t.lr * t.min_lr_ratio
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(params: List[torch.nn.Parameter], cfg: RunConfig,
                   fused: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms, biases and gains are not decayed)."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    rest = [p for p in params if p.requires_grad and p.dim() < 2]
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)


def _process_start_s() -> float:
    import psutil

    return psutil.Process().create_time()


def cpu_peak_rss_bytes() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


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
    # Low-rank training (switch.LowRankController): may factorize the model mid-run and hand
    # back a new optimizer; its state rides in every checkpoint. None: plain full rank.
    lowrank: Optional[Any] = None


def micro_batches(ctx: LoopContext, split: str, step: int, count: int) -> List[Batch]:
    """This data-parallel rank's share of the step's global batch, as micro-batches."""
    seq = ctx.cfg.model.seq_len
    rows = ctx.data.offsets(ctx.cfg.train.seed, split, step, count, seq)
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
    t = ctx.cfg.train
    # The same sequences for every layout (when eval_batches is a multiple of dp), split
    # across data-parallel ranks; rounded up to whole micro-batches on every rank otherwise.
    per = ctx.layout.micro_batch * ctx.engine.dp_size
    count = -(-t.eval_batches * ctx.layout.micro_batch // per) * per
    return ctx.data.val_losses(
        lambda split: ctx.engine.eval_loss(micro_batches(ctx, split, 0, count)))


def resume(ctx: LoopContext, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer, RNG and data position from the newest whole checkpoint; returns
    the first step to run."""
    # A sharded checkpoint loads in place, into the shapes of this layout: hence the template.
    found = ctx.ckpt.load_latest(template=lambda: {
        "model": ctx.engine.state_dict(), "optimizer": ctx.engine.optim_state_dict(optimizer)})
    if found is None:
        return 0
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
             "layout": ctx.layout.key()}
    if ctx.lowrank is not None:
        state["lowrank"] = ctx.lowrank.state_dict()
    ctx.ckpt.save(next_step, state)


def train(ctx: LoopContext) -> Dict[str, float]:
    """Run steps [resume point, train.steps); returns the last metrics."""
    cfg, t = ctx.cfg, ctx.cfg.train
    lowrank = ctx.lowrank
    if lowrank is not None:  # restores its state (factorized shapes) before the optimizer
        lowrank.prepare(ctx.ckpt)
        optimizer = lowrank.make_optimizer()
    else:
        optimizer = make_optimizer(ctx.engine.parameters(), cfg,
                                   fused=ctx.engine.device.type == "cuda")
    start = resume(ctx, optimizer)
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
        lr = lr_at(step, cfg) * (lowrank.lr_factor(step) if lowrank is not None else 1.0)
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
        last = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time_s,
                "tokens_per_s": tokens_per_s,
                "mfu": ctx.flops_per_token * tokens_per_s
                / (ctx.peak_flops_per_device * ctx.world_size),
                "peak_mem_bytes": ctx.engine.peak_mem_bytes(), **ctx.engine.comm_bytes()}
        if lowrank is not None:  # stable ranks; at the switch, a factorized model and optimizer
            optimizer, extra = lowrank.after_step(step, optimizer, lr)
            last.update(extra)
        if step == start:  # startup cost as a user feels it: process start to first step done
            last["time_to_first_step_s"] = time.time() - _process_start_s()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower train.lr")
        if step % t.log_every == 0 or step == t.steps - 1:
            log(last, step)
        if ctx.on_step is not None:
            ctx.on_step(step, last)
        if (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps:
            if step + 1 == t.steps:
                vals = evaluate(ctx)
                last.update(vals)
                log(vals, step + 1)
            save(ctx, optimizer, step + 1)
        elif ctx.stop_requested is not None and ctx.engine.any_rank(ctx.stop_requested()):
            save(ctx, optimizer, step + 1)
            last["stopped_at"] = step + 1
            break
    if lowrank is not None:
        lowrank.finish()
    ctx.tracker.flush()
    return last
