"""Compute time of one micro-batch on one rank: GEMMs, the attention core, elementwise kernels,
the LM head and the loss.

A GEMM runs at the achieved tensor-core peak times how much of it its shape keeps
(workbench.plan.cost.gemm_fill), but never faster than streaming its operands through HBM
(roofline, Williams et al. 2009). Elementwise kernels are HBM bound: bytes moved per stored
activation byte (Coefficients.elem_traffic) over the achieved HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from workbench.plan.cost.activations import quad_fwd_bytes
from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.gemm_fill import dim_fill, tile_fill
from workbench.plan.cost.per_rank import PerRank
from workbench.plan.cost.shapes import Linear, ModelShape, fp8_operand_elems
from workbench.plan.cost.software import Software


@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch on one rank: per layer, and for the LM head and loss of the
    last stage."""

    gemm_s: np.ndarray  # forward GEMMs of a layer
    attention_s: np.ndarray  # forward attention core of a layer
    elementwise_s: np.ndarray  # forward elementwise kernels of a layer (HBM bound)
    core_elementwise_s: np.ndarray  # the part of elementwise_s on the attention core's tensors
    layer_fwd_s: np.ndarray  # whole forward of a layer
    layer_bwd_s: np.ndarray  # whole backward of a layer
    head_s: np.ndarray  # LM head GEMM (forward)
    loss_s: np.ndarray  # loss elementwise (forward)
    # Backward of the head and loss where measured (None: twice their forward).
    ends_bwd_s: Optional[np.ndarray] = None


def attn_bwd_factor(software: Software) -> float:
    """Backward over forward attention time: flash backward recomputes the scores (2.5)."""
    return 2.5 if software.flash_attention else 2.0


def ring_attention_factor(cp: np.ndarray, seq_len: float, software: Software,
                          coeff: Coefficients) -> np.ndarray:
    """Attention time with context parallelism relative to the same FLOPs in one kernel.

    Ring attention runs one kernel per ring step on a KV chunk of s/cp tokens (s/2cp halves with
    load balancing), and a fused kernel's efficiency falls on short sequences (fixed prologue,
    softmax rescaling and tail tiles: chunk / (chunk + ring_chunk_half), relative to the whole
    sequence). Without load balancing the causal mask leaves rank i with i+1 blocks while every
    ring step waits for the slowest rank: (2cp-1)/cp times the balanced time."""
    chunk = seq_len / (cp * (2.0 if software.cp_load_balance else 1.0))
    kernel = dim_fill(seq_len, coeff.ring_chunk_half) / dim_fill(chunk, coeff.ring_chunk_half)
    imbalance = 1.0 if software.cp_load_balance else (2 * cp - 1) / cp
    return np.where(cp > 1, kernel * imbalance, 1.0)


def gemm_s(linears: tuple[Linear, ...], rank: PerRank, coeff: Coefficients,
           software: Software) -> np.ndarray:
    """Forward GEMM time of one block: tensor-core time at the shape's efficiency, but never
    less than streaming its operands and output through HBM once. A narrow per-rank GEMM (a GQA
    K/V projection under high TP; a low-rank factor) has about n FLOPs per byte, under the
    ridge point of the GPU, so bandwidth, not FLOPs, sets its time. Backward GEMMs (dX, dW)
    move the same operand and output sizes, so 2x forward stays right for them too."""
    tp, tokens, elem_bytes = rank.cols["tp"], rank.tokens, software.act_bytes
    mm_speed = 1.0 if software.precision != "fp8" else coeff.fp8_te_mm_speedup \
        if software.fp8_scaling == "te_delayed" else coeff.fp8_mm_speedup
    # GEMM operand bytes (FP8: cast operands)
    operand_bytes = 1.0 if software.precision == "fp8" else elem_bytes
    total = 0.0
    for rows, cols, column_parallel in linears:
        rows_here, cols_here = (rows, cols / tp) if column_parallel else (rows / tp, cols)
        fill = tile_fill(tokens, cols_here, rank.tile_sms) if rank.tile_sms else \
            rank.row_fill * dim_fill(np.minimum(rows_here, cols_here), coeff.mm_dim_half)
        eff = coeff.mm_eff_max * fill * mm_speed
        tensor_core = 2.0 * tokens * rows_here * cols_here / (rank.peak_flops * eff)
        stream = (operand_bytes * (tokens * rows_here + rows_here * cols_here)
                  + elem_bytes * tokens * cols_here) / rank.hbm_bytes_per_s
        total = total + np.maximum(tensor_core, stream)
    return total


def compute(shape: ModelShape, coeff: Coefficients, software: Software, rank: PerRank
            ) -> Compute:
    """GEMMs of one block (dense and factorized blocks averaged by their share), attention,
    elementwise traffic, and the LM head and loss (kept in BF16 even in FP8 recipes)."""
    tp, cp, tokens = rank.cols["tp"], rank.cols["cp"], rank.tokens
    seq, hbm, peak = float(shape.seq_len), rank.hbm_bytes_per_s, rank.peak_flops
    lowrank_share = shape.lowrank_layers / shape.n_layers
    gemm = gemm_s(shape.dense, rank, coeff, software) * (1 - lowrank_share)
    if lowrank_share > 0:
        gemm = gemm + gemm_s(shape.lowrank, rank, coeff, software) * lowrank_share
    attn_flops = 4.0 * tokens * seq * shape.q_width / tp  # counted without the causal saving
    if software.flash_attention:  # the causal mask lets a fused kernel skip half the tiles
        attention = 0.5 * attn_flops / (peak * coeff.flash_eff * (
            coeff.flash1_rel_speed if software.flash_v1 else 1.0))
    else:  # batched GEMMs with K = head_dim
        attention = attn_flops / (peak * coeff.mm_eff_max * rank.row_fill
                                  * dim_fill(shape.head_dim, coeff.mm_dim_half))
    if not software.cp_allgather:
        attention = attention * ring_attention_factor(cp, seq, software, coeff) \
            + (cp - 1) * coeff.ring_merge_bytes * tokens * shape.q_width / tp / hbm
    act = rank.activations
    core_bytes = quad_fwd_bytes(shape, software, tp, rank.elem_traffic * act["quad"])  # s*s
    elementwise = tokens * (rank.elem_traffic_rep * act["rep"] + rank.elem_traffic * act["split"]
                            + core_bytes) / hbm
    if software.precision == "fp8" and software.fp8_scaling == "rowwise":
        # per-operand amax + cast kernels
        elementwise = elementwise + coeff.fp8_rowwise_cast_bytes * tokens \
            * fp8_operand_elems(shape, tp) / hbm
    head = 2 * tokens * float(shape.hidden) * shape.vocab / tp / (
        peak * coeff.mm_eff_max * rank.row_fill * dim_fill(shape.vocab / tp, coeff.mm_dim_half))
    loss_tp = 1.0 if software.gathered_logits else tp  # the loss sees 1/tp of the vocab or all
    return Compute(
        gemm_s=gemm, attention_s=attention, elementwise_s=elementwise,
        core_elementwise_s=tokens * core_bytes / hbm,
        layer_fwd_s=gemm + attention + elementwise + coeff.kernel_overhead_s,
        layer_bwd_s=2 * gemm + attn_bwd_factor(software) * attention + 2 * elementwise
        + 2 * coeff.kernel_overhead_s, head_s=head,
        loss_s=software.loss_fwd_bytes_per_logit(rank.elem_traffic) * tokens * shape.vocab
        / loss_tp / hbm)
