"""What one device computes, timed at the shapes of the models the user trains: the GEMMs of a
block and the LM head (forward, and the two backward GEMMs), a whole block (what the GEMMs leave
out: attention, norms, RoPE, activations, residual adds, autograd's own work), the loss, the
optimizer step, and elementwise bandwidth with its per-operation overhead.

Why at the model's shapes rather than one peak: a GEMM's throughput falls with its smaller
dimensions (tiles, waves, cache blocking), and the per-rank shapes of a layout are the small
ones (a K/V projection under tensor parallelism, a micro-batch of one sequence).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig, RunConfig
from workbench.profile.timing import Timing, median_s
from workbench.train.model import Block, build, cross_entropy, rope_tables
from workbench.train.optimizer import make_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Ops = Dict[str, Callable[[], object]]  # an operation to time, by part (fwd, bwd, both)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Gemm:
    """One linear's matrices at a token count: (tokens, k) @ (k, n)."""

    k: int  # input features
    n: int  # output features


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Training's precision: fp32 master weights, bf16 matmuls under autocast."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gemm_ops(shape: Gemm, tokens: int, dtype: str, device: torch.device) -> Ops:
    """One linear's forward, y = x W^T, and its backward, dX = dY W and dW = dY^T X (the two
    products autograd runs for it)."""
    dt = DTYPES[dtype]
    x = torch.randn(tokens, shape.k, device=device, dtype=dt)
    w = torch.randn(shape.n, shape.k, device=device, dtype=dt)
    dy = torch.randn(tokens, shape.n, device=device, dtype=dt)
    return {"fwd": lambda: F.linear(x, w), "bwd": lambda: (dy.mm(w), dy.t().mm(x))}


def rank_block(cfg: ModelConfig, tp: int) -> Block:
    """One block as a tensor-parallel rank of degree `tp` holds it: heads and the FFN width
    split tp ways, norms whole (the model's own Block, its linears cut to the rank's share)."""
    block = Block(cfg)
    att, ffn = block.attention, block.feed_forward
    hd = cfg.hidden // cfg.n_heads
    q, kv = cfg.n_heads * hd // tp, cfg.n_kv_heads * hd // tp
    att.wq, att.wk, att.wv = (nn.Linear(cfg.hidden, n, bias=cfg.bias) for n in (q, kv, kv))
    att.wo = nn.Linear(q, cfg.hidden, bias=cfg.bias)
    ffn.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden // tp, bias=cfg.bias)
    if ffn.gated:
        ffn.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden // tp, bias=cfg.bias)
    ffn.w2 = nn.Linear(cfg.ffn_hidden // tp, cfg.hidden, bias=cfg.bias)
    return block


def batch_shape(tokens: int, seq_len: int) -> tuple[int, int]:
    """(sequences, length) of a micro-batch of `tokens` on one rank: whole sequences, or one
    shortened sequence when context parallelism gives a rank part of one."""
    if tokens >= seq_len:
        return tokens // seq_len, seq_len
    return 1, tokens


def block_ops(cfg: ModelConfig, tp: int, tokens: int, dtype: str, device: torch.device) -> Ops:
    """One training block at `tokens` per micro-batch: its forward, and forward + backward."""
    block = rank_block(cfg, tp).to(device)
    b, s = batch_shape(tokens, cfg.seq_len)
    rope = rope_tables(cfg, device)[:s] if cfg.family == "llama" else None
    x = torch.randn(b, s, cfg.hidden, device=device, requires_grad=True)
    grad = torch.randn(b, s, cfg.hidden, device=device)

    def forward() -> torch.Tensor:
        with autocast(device, dtype):
            return block(x, rope)

    def both() -> None:
        forward().backward(grad)

    return {"fwd": forward, "both": both}


def keep_busy(cfg: ModelConfig, dtype: str, device: torch.device, threads: int,
              done: Callable[[], bool]) -> None:
    """Compute as a rank of a run does (one sequence through a block, forward and backward,
    over and over) until `done`: while one rank times, the others sharing its cores keep them
    as busy as a run's ranks would, every moment of every timing alike (why:
    `rank.oversubscribed`, where it is used)."""
    torch.set_num_threads(threads)
    work = block_ops(cfg, 1, cfg.seq_len, dtype, device)["both"]
    while not done():
        work()


def loss_ops(cfg: ModelConfig, tp: int, tokens: int, dtype: str, device: torch.device) -> Ops:
    """The cross-entropy over a rank's logits (the head GEMM is a Gemm of its own), softmax
    over vocab/tp columns in fp32 as training computes it: forward, and forward + backward."""
    b, s = batch_shape(tokens, cfg.seq_len)
    logits = torch.randn(b, s, cfg.vocab // tp, device=device, dtype=DTYPES[dtype],
                         requires_grad=True)
    target = torch.randint(0, cfg.vocab // tp, (b, s), device=device)
    return {"fwd": lambda: cross_entropy(logits, target),
            "both": lambda: cross_entropy(logits, target).backward()}


def optimizer_times(cfg: RunConfig, device: torch.device, timing: Timing = Timing()
                    ) -> Dict[str, float]:
    """Seconds of one optimizer step of the whole model (AdamW as training builds it, gradient
    clipping and zeroing included), and its parameter and tensor counts: the memory-bound
    update the cost model charges per parameter."""
    model = build(cfg.model, cfg.train.seed, device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(params, cfg, fused=device.type == "cuda")

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()

    seconds = median_s(step, device, Timing(timing.trial_s, 3))
    return {"params": float(sum(p.numel() for p in params)), "tensors": float(len(params)),
            "step_s": seconds}


def elementwise_curve(device: torch.device, sizes_bytes: Sequence[int],
                      timing: Timing = Timing()) -> Dict[str, List[float]]:
    """Seconds of an out-of-place fp32 add (two reads, one write) at each size: the small sizes
    give the per-operation overhead, the large ones the memory bandwidth."""
    rows: Dict[str, List[float]] = {"bytes": [], "s": []}
    for nbytes in sizes_bytes:
        n = max(1, nbytes // 4)
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        out = torch.empty_like(a)
        seconds = median_s(lambda a=a, b=b, out=out: torch.add(a, b, out=out), device, timing)
        rows["bytes"].append(float(3 * 4 * n))
        rows["s"].append(seconds)
    return rows
