"""Context parallelism (train/parallel/context.py): the head-tail split gives every cp rank the
sequence once and the same causal work; a GPT-2-family model (learned positions, tied
embeddings) and a grouped-query model train under cp=2 with the single-process losses. The
Llama-family cases at 2 and 4 ranks are in test_parallel.py and test_parallel_4ranks.py."""

from __future__ import annotations

import pytest
import torch
from test_parallel import assert_matches_single_process, reference, run_matrix

from workbench.compose import compose
from workbench.errors import ConfigError
from workbench.layout import Layout
from workbench.plan.search.rules import validate_layout
from workbench.train.parallel.context import cp_positions

GPT2 = ["model.family=gpt2", "model.bias=true", "model.tie_embeddings=true", "train.steps=2"]
GQA = ["model.n_kv_heads=2", "train.steps=2"]  # 4 query heads share 2 K/V heads


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_head_tail_split_covers_the_sequence_with_equal_causal_work(cp):
    seq = 64
    parts = [cp_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
    # keys a query at position p attends to: p + 1; each rank's sum is the same
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_sequence_not_divisible_by_two_cp_is_rejected():
    cfg = compose(["model=gpt_tiny", "model.seq_len=130"])
    with pytest.raises(ConfigError) as err:
        validate_layout(Layout(cp=2, grad_accum=4), cfg.model, 2)
    assert err.value.key == "layout.cp" and "2*cp = 4" in err.value.valid


@pytest.mark.parametrize("model", [GPT2, GQA], ids=["gpt2", "gqa"])
def test_other_model_shapes_under_context_parallel_match_single_process(tmp_path, model):
    results = run_matrix(2, {"cp": ["layout.cp=2"]}, tmp_path, extra_overrides=model)
    ref = reference(tmp_path, model)
    assert_matches_single_process(results["cp-rc_none"], ref)
    assert_matches_single_process(results["cp-rc_full"], ref)
