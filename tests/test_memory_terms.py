"""Memory itemization rules of workbench.plan.cost.activations and .memory that the published-runs
benchmark relies on: what an unfused stack keeps for the backward, without changing any time
term."""

from __future__ import annotations

import math
from dataclasses import replace

from workbench.compose import compose
from workbench.layout import Layout
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.software import Software

BASE = Software(precision="bf16", flash_attention=True)


def _est(sw: Software, lay: Layout):
    c = compose(["model=llama3_8b", "cluster=h100_8x_ib", "train.dtype=bf16"])
    return estimate(c.model, c.cluster, c.train, lay, software=sw)


def test_unfused_ops_add_their_saved_tensors_and_no_time() -> None:
    """An eager RMSNorm keeps an fp32 copy of its input and the normalized tensor where a fused
    one keeps the 16-bit input (4 + 2 - 2 bytes, 2 a layer, h wide), an eager SwiGLU one
    more ffn-wide tensor, eager attention 3 copies of the Q width: exactly those bytes per
    token, layer and micro-batch in flight are added to the activations, split over TP where
    the tensor is, and the step time does not move (the unfused kernels' traffic is a time
    coefficient's business)."""
    lay = Layout(dp_replicate=8, tp=2, pp=2, micro_batch=1, grad_accum=4)
    c = compose(["model=llama3_8b"]).model
    tok, e, tp = c.seq_len, 2.0, 2
    base = _est(BASE, lay)
    per_layer_mb = {
        "unfused_norm": 2 * (4.0 + e - e) * c.hidden,  # no sequence parallel: replicated over TP
        "unfused_swiglu": e * c.ffn_hidden / tp,
        "attention_copies": 3 * e * c.hidden / tp,  # q_width == hidden for Llama 3 8B
    }
    for flag, extra_per_token in per_layer_mb.items():
        est = _est(replace(BASE, **{flag: True}), lay)
        assert est.step_time_s == base.step_time_s, flag
        added = est.mem_bytes["mem_activations_bytes"] - base.mem_bytes["mem_activations_bytes"]
        # first stage: 16 layers x 2 micro-batches in flight under 1F1B
        assert math.isclose(added, extra_per_token * tok * 16 * 2, rel_tol=1e-9), flag
        assert est.peak_mem_bytes > base.peak_mem_bytes


def test_eager_norm_keeps_an_fp32_copy_unless_training_in_fp32() -> None:
    """`_norm(x.float()).type_as(x) * weight` saves the fp32 copy and the cast-back normalized
    tensor (16-bit: 4 + 2 bytes an element); in fp32 `.float()` is the input itself (4 + 4)."""
    from workbench.plan.cost.activations import eager_norm_bytes_per_elem

    assert eager_norm_bytes_per_elem(2.0) == 6.0
    assert eager_norm_bytes_per_elem(4.0) == 8.0


def test_published_stacks_set_the_unfused_facts() -> None:
    """The Aleph Alpha stack's description has these facts (and only its rows); without its
    RMS kernel (norm_kernel false) its norm is eager ops too."""
    from workbench.plan.accuracy.published import row_software

    aa = row_software({"stack": "aleph_alpha_scaling", "norm_kernel": "false"})
    assert aa.unfused_swiglu and aa.attention_copies and aa.unfused_norm
    kernel = row_software({"stack": "aleph_alpha_scaling"})
    assert kernel.unfused_swiglu and not kernel.unfused_norm
    titan = row_software({"stack": "torchtitan"})
    assert not (titan.unfused_swiglu or titan.attention_copies or titan.unfused_norm)


def test_interleaved_inflight_is_megatrons_warmup_capped_at_all_forwards() -> None:
    """Rank r of an interleaved 1F1B holds 2 (pp - 1 - r) + (v - 1) N + 1 chunk forwards (N = pp
    by default), never more than all ga x v of them: Llama 3 405B's pp 16, v 8 with 16
    micro-batches holds 16 a layer (all forwards), with 32 it holds 143 / 8 on rank 0 and
    141 / 8 on rank 1; a group N = 8 holds 2 x 15 + 7 x 8 + 1 = 87 chunks on rank 0."""
    import numpy as np

    from workbench.plan.cost.memory import inflight_per_layer

    def on(pp: float, ga: float, v: float, group: float = 0.0) -> tuple[float, float]:
        f, s = inflight_per_layer(np.array([pp]), np.array([ga]), np.array([False]),
                                  np.array([True]), np.array([v]), group)
        return float(f[0]), float(s[0])

    assert on(16, 16, 8) == (16.0, 16.0)
    assert on(16, 32, 8) == (143 / 8, 141 / 8)
    assert on(16, 32, 8, group=8) == (87 / 8, 85 / 8)
    one_f_one_b, _ = inflight_per_layer(np.array([4.0]), np.array([8.0]), np.array([False]),
                                        np.array([False]), np.array([1.0]))
    assert float(one_f_one_b[0]) == 4.0


def test_explain_names_the_rank_that_peaks_and_its_parts_add_up() -> None:
    """Llama 3 405B's own layout (16 ranks x 8 virtual stages, one layer each, embedding and
    head alone on the first and last virtual stage) peaks on a middle rank: it holds 8 layers,
    the first one 7; --explain says so, and its lines sum to the total."""
    from workbench.plan.cost.explain import explain, render

    c = compose(["model=llama3_405b", "cluster=h100_8x_ib", "cluster.nodes=2048",
                 "train.global_batch=2048", "train.dtype=bf16"])
    key = "dpr1_dps128_tp8_pp16_cp1_sp_mb1_ga16_rc-none_interleaved-1f1b-v8_sl0-1x126-0"
    x = explain(c.model, c.cluster, c.train, key)
    assert x.peak_rank == 1 and "middle pipeline stage" in render(x)[1]
    assert math.isclose(sum(x.memory_bytes.values()), x.peak_bytes, rel_tol=1e-12)
