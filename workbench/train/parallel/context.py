"""Context parallelism: each rank of the "cp" mesh dimension holds a slice of every sequence.

The method is the all-gather one Llama 3 trained with (Dubey et al. 2024, sec. 3.3.2), written
anew here: queries stay local; keys and values are all-gathered over the cp group before
attention (their backward is a reduce-scatter); a boolean mask over global positions keeps
attention causal. Each rank owns two chunks of the sequence, chunk r and chunk 2cp-1-r, so
every rank has the same causal work (the head-tail load balance).

Why not PyTorch's `context_parallel` (ring attention): its handlers rewrite only the CUDA SDPA
kernels (flash, memory-efficient, cuDNN) and the CPU path has none, so it cannot run, or be
tested, on gloo. This runs on gloo with the same losses as one process, and the same code serves
NCCL (where it has not been run yet). It costs the K/V of the whole sequence per layer in memory
(GQA keeps that small), and its all-gather is not overlapped with attention.

The model does not know: `apply_cp` swaps each attention's `core` module and replaces the
position buffers (RoPE table, learned-position ids) by this rank's positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.train.model import Transformer


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks r and 2cp-1-r of 2cp equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, last])


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradient back to its owner."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM,
                                    group=ctx.group)
        return out, None


class ContextParallelAttention(nn.Module):
    """Local queries against the cp group's keys and values, causal over global positions.

    Input q (B, H, T_local, D), k/v (B, Hkv, T_local, D). One all-gather carries K and V.
    `mask` (T_local, S) is shared by every layer of the rank (see causal_mask)."""

    def __init__(self, group: Any, mask: torch.Tensor):
        super().__init__()
        self.group = group
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = torch.stack([k, v]).movedim(3, 0)  # (T_local, 2, B, Hkv, D)
        k, v = _GatherSeq.apply(kv, self.group).movedim(0, 3)
        if k.shape[1] != q.shape[1]:
            # Grouped-query attention: SDPA's GQA runs only in the flash and math kernels, and
            # flash takes no mask, so CUDA would fall back to math (scores materialized). Heads
            # repeated after the gather keep the memory-efficient kernel, which takes the mask.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def causal_mask(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """mask[i, j]: gathered key j (keys arrive in rank order) is at or before local query i."""
    q_pos = cp_positions(seq_len, cp, cp_rank)
    k_pos = torch.cat([cp_positions(seq_len, cp, r) for r in range(cp)])
    return k_pos[None, :] <= q_pos[:, None]


def apply_cp(model: Transformer, group: Any, cp: int, cp_rank: int) -> None:
    """Give this rank's positions to the position buffers and the cp attention to every
    block present (a pipeline stage holds some); one mask serves all of them."""
    seq_len = model.cfg.seq_len
    pos = cp_positions(seq_len, cp, cp_rank)
    if model.rope is not None:
        model.rope = model.rope[pos.to(model.rope.device)]
    if model.positions is not None:
        model.positions = model.positions[pos.to(model.positions.device)]
    mask: dict[torch.device, torch.Tensor] = {}
    for block in model.layers.values():
        device = next(block.parameters()).device
        if device not in mask:
            mask[device] = causal_mask(seq_len, cp, cp_rank).to(device)
        block.attention.core = ContextParallelAttention(group, mask[device])
