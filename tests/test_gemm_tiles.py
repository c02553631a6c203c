"""Ampere GEMM tile/wave quantization, the eager-norm split and FlashAttention 1 rows: what each
costs, by counting.

The expected numbers are tile and byte counts, not fitted figures, so a coefficient change
does not break them; a change to what is counted does.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from workbench.config import ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.accuracy.predict import read_rows
from workbench.plan.accuracy.published import row_case
from workbench.plan.cost.coefficients import defaults_for
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.gemm_fill import tile_fill
from workbench.plan.cost.hardware import cluster_for, match_gpu
from workbench.plan.cost.software import Software


def test_a_full_wave_wastes_nothing_and_a_second_part_wave_costs_a_whole_one() -> None:
    # 2304 x 1536 = 9 x 12 tiles of 256x128 = 108: one full wave on an A100
    assert tile_fill(np.array([2304.0]), 1536.0, 108)[0] == pytest.approx(1.0)
    # 2048 x 1920 = 120 tiles (either orientation): 2 waves of 108 slots for 120 tiles' work
    assert tile_fill(np.array([2048.0]), 1920.0, 108)[0] == pytest.approx(
        2048 * 1920 / (216 * 256 * 128))
    # a 64-wide output pays a whole 128-wide tile: at most half useful
    assert tile_fill(np.array([4096.0]), 64.0, 108)[0] <= 0.5


def test_waves_count_on_ampere_only() -> None:
    assert match_gpu("A100 80GB").sm_count == 108 and match_gpu("H100 SXM").sm_count == 132
    assert defaults_for("A100-SXM-80GB").gemm_tile_waves == 1.0
    assert defaults_for("H100-SXM-80GB").gemm_tile_waves == 0.0


MODEL = ModelConfig(name="13b", family="llama", n_layers=8, hidden=5120, n_heads=40,
                    n_kv_heads=40, ffn_hidden=13824, vocab=32000, seq_len=2048)


def _fwd_s(gpu: str, tp: int, mb: int, sw: Software, waves: float | None = None) -> float:
    lay = Layout(dp_replicate=1, tp=tp, micro_batch=mb, grad_accum=1)
    train = TrainConfig(global_batch=mb, micro_batch=mb, dtype="bf16")
    coeff = None if waves is None else {"gemm_tile_waves": waves}
    return estimate(MODEL, cluster_for(gpu, tp, coeff=coeff), train, lay,
                    software=sw).time_s["time_fwd_s"]


def test_a100_loses_more_per_token_at_one_sequence_than_the_smooth_curve_says() -> None:
    # TP 4 on one 2k sequence leaves part-filled waves; 4 sequences fill them better
    def ratio(waves: float) -> float:
        return _fwd_s("A100-SXM-80GB", 4, 1, Software(), waves) / (
            _fwd_s("A100-SXM-80GB", 4, 4, Software(), waves) / 4)

    assert ratio(1.0) > ratio(0.0) + 0.02


def test_eager_norms_cost_the_same_on_every_tp_rank() -> None:
    # without SP the replicated norm/residual traffic does not shrink with TP, so the eager
    # stack's extra forward time over the fused one is about the same at TP 1 and TP 8
    fused, eager = Software(), Software(eager=True)
    extra = [_fwd_s("H100-SXM-80GB", tp, 1, eager) - _fwd_s("H100-SXM-80GB", tp, 1, fused)
             for tp in (1, 8)]
    share_rep = extra[1] / extra[0]
    assert 0.6 < share_rep < 1.0  # the TP-split eager part shrinks 8x, the replicated part not


def test_hagemann_rows_carry_the_codes_uniform_pipeline_split() -> None:
    from pathlib import Path

    _, rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "calibration"
                        / "hagemann2023_layouts.csv")
    row = next(r for r in rows if r["pp"] == "2" and r["n_layers"] == "40")
    assert row["stage_layers"] == "21-19"  # embedding + 21 layers | 19 layers + norm + head
    assert row_case(row).layout.stage_layers == (21, 19)


def test_flash_attention_1_rows_run_the_attention_core_at_half_the_fa2_rate() -> None:
    from workbench.plan.accuracy.published import row_software

    v1, v2 = (row_software({"stack": "aleph_alpha_scaling", "attention_kernel": k})
              for k in ("flash1", "flash2"))
    assert v1.flash_v1 and not v2.flash_v1
    lay = Layout(dp_replicate=1, tp=1, micro_batch=1, grad_accum=1)
    train = TrainConfig(global_batch=1, micro_batch=1, dtype="bf16")
    t1, t2 = (estimate(MODEL, cluster_for("A100-SXM-80GB", 1), train, lay,
                       software=replace(v2, flash_v1=f)).time_s["time_fwd_s"]
              for f in (True, False))
    # only the attention core changes: 8 layers x 2 x (s^2/2 causal x q_width) FLOPs at flash_eff
    co = defaults_for("A100-SXM-80GB")
    attn_s = 8 * 0.5 * 4.0 * 2048 * 2048 * 5120 / (312e12 * co.flash_eff)
    assert t1 - t2 == pytest.approx(attn_s * (1 / co.flash1_rel_speed - 1), rel=1e-6)
