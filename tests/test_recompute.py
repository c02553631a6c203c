"""Activation recomputation policies on one process: `full` re-runs every block's forward in
the backward, `selective` every other block (odd global index), `selective_op` every block
but only some of its ops, `none` none; the gradients are bitwise those of no recomputation,
and what the op policy keeps is what the cost model itemizes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.compose import compose
from workbench.plan.cost.activations import (
    activation_bytes_per_token,
    op_policy_items,
    op_policy_share,
)
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.train.model import build, cross_entropy
from workbench.train.parallel.recompute import apply_recompute


def forward_calls_and_grads(mode: str):
    cfg = compose(["model=gpt_tiny"]).model
    model = build(cfg, seed=0)
    apply_recompute(model, mode)
    calls: Counter = Counter()
    for key, block in model.layers.items():
        # the block's own forward is replaced; its submodules are still called as modules
        block.attention.register_forward_pre_hook(lambda *_, k=key: calls.update([k]))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=gen)
    cross_entropy(model(x), torch.roll(x, -1, dims=1)).backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode, recomputed", [("none", set()), ("full", {"0", "1", "2", "3"}),
                                              ("selective", {"1", "3"})])
def test_recompute_policy_reruns_the_right_blocks_with_equal_gradients(mode, recomputed):
    calls, grads = forward_calls_and_grads(mode)
    assert {k for k, n in calls.items() if n == 2} == recomputed
    assert all(n in (1, 2) for n in calls.values()) and len(calls) == 4
    _, reference = forward_calls_and_grads("none")
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


class _OpCount(TorchDispatchMode):
    """aten ops the backward runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> tuple[Counter, dict]:
    cfg = compose(["model=gpt_tiny"]).model
    model = build(cfg, seed=0)
    apply_recompute(model, mode)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(model(x), torch.roll(x, -1, dims=1))
    with _OpCount() as count:
        loss.backward()
    return count.ops, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_op_policy_redoes_every_second_matmul_and_never_the_attention() -> None:
    """`selective_op` keeps the 1st, 3rd, ... matmul of each block (q, v, w1, w2 of a Llama
    block) and redoes the 2nd, 4th, ... (k, o, w3): three matmuls a block more in the backward
    than without recompute, where the cost model charges exactly that share of the GEMM FLOPs;
    the attention core is never re-run (full recompute re-runs it in every block); the
    gradients are bitwise those of no recompute."""
    none, reference = backward_ops("none")
    op, grads = backward_ops("selective_op")
    full, _ = backward_ops("full")
    blocks, mm, sdpa = 4, "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu"
    assert op[mm] - none[mm] == blocks * 3
    assert op[sdpa + ".default"] == 0 and full[sdpa + ".default"] == blocks
    assert all(torch.equal(grads[n], reference[n]) for n in reference)
    ms = model_shape(compose(["model=gpt_tiny"]).model)
    share = op_policy_share(ms, Software(precision="fp32", flash_attention=True))
    wk, wo, w3 = ms.dense[1], ms.dense[3], ms.dense[5]
    assert share == pytest.approx(sum(m * n for m, n, _ in (wk, wo, w3))
                                  / sum(m * n for m, n, _ in ms.dense))


# What one forward leaves alive, measured as the resident size in a fresh interpreter with the
# C allocator's mmap threshold pinned at 64 KiB, so every tensor of a block is its own mapping,
# returned on free (glibc otherwise raises the threshold after a free and keeps the pages).
KEPT = r"""
import sys, torch
from workbench.compose import compose
from workbench.train.model import build, cross_entropy
from workbench.train.parallel.recompute import apply_recompute
cfg = compose(sys.argv[2:]).model
model = build(cfg, seed=0)
apply_recompute(model, sys.argv[1])
x = torch.randint(0, cfg.vocab, (16, cfg.seq_len), generator=torch.Generator().manual_seed(0))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
before = rss()
loss = cross_entropy(model(x), torch.roll(x, -1, dims=1))
print(rss() - before)
loss.backward()
"""


def _kept_bytes(mode: str, overrides: list[str]) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", KEPT, mode, *overrides], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_op_policy_keeps_what_the_cost_model_itemizes() -> None:
    """Over full recompute (which keeps each block's input, as the op policy does too) the op
    policy keeps q, v, w1's and w2's outputs, the attention output and its log-sum-exp:
    activations.op_policy_items, measured within 5% on 16 x 512 tokens of four fp32 blocks
    (235 MB predicted; 237.5 MB measured when written)."""
    overrides = ["model=gpt_tiny", "model.hidden=256", "model.ffn_hidden=768",
                 "model.seq_len=512"]
    cfg = compose(overrides).model
    ms = model_shape(cfg)
    sw = Software(precision="fp32", flash_attention=True)
    act = activation_bytes_per_token(ms, sw, np.ones(1), np.zeros(1))
    kept = op_policy_items(ms, sw, act, np.ones(1), np.zeros(1))[1][0]
    predicted = (kept - act["input"][0]) * 16 * cfg.seq_len * cfg.n_layers
    measured = _kept_bytes("selective_op", overrides) - _kept_bytes("full", overrides)
    assert measured == pytest.approx(predicted, rel=0.05)


def test_op_policy_keeps_whichever_fused_attention_kernel_sdpa_picks() -> None:
    """On a GPU SDPA may run flash, memory-efficient or cuDNN attention (the CPU runs its own
    flash path): the policy keeps every one of them, as the cost model assumes, and at least
    the kernels of this torch's dispatcher that a GPU run reaches."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from workbench.train.parallel.recompute import FUSED_ATTENTION, op_policy

    names = {str(op) for op in FUSED_ATTENTION}
    assert {"aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default"} <= names
    for op in FUSED_ATTENTION:
        ctx = SimpleNamespace(is_recompute=False)
        assert op_policy({False: 0, True: 0}, ctx, op) == CheckpointPolicy.MUST_SAVE, op
