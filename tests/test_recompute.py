"""Activation recomputation policies on one process: `full` re-runs every block's forward in
the backward, `selective` every other block (odd global index), `none` none; the gradients
are bitwise those of no recomputation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from workbench.cli import compose
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
