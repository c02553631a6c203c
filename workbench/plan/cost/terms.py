"""The cost model's formulas, written once over numpy arrays of layouts.

`estimate()` evaluates them on one layout and `search` on millions at once, so the exhaustive
ranking and the single prediction can never disagree. Every array holds one value per layout
(the columns of workbench.plan.columns); model and hardware figures are scalars. Times are per
optimizer step on one GPU of the slowest pipeline stage; memory is per GPU of the fullest stage.

`evaluate` runs four parts, each returning named arrays: `compute` (GEMM, attention and
elementwise time of one layer), `communication` (tensor/sequence and context parallel time of
one layer), `step_times` (one micro-batch of the stage, the pipeline, data parallel and the
optimizer) and `memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.plan.cost import stages
from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.columns import Columns, Schedule
from workbench.plan.cost.gemm_tiles import tile_fill
from workbench.plan.cost.hardware import GpuSpec
from workbench.plan.cost.links import collective_link, group_bw
from workbench.plan.cost.memory_terms import (
    activation_bytes_per_token,
    gather_bytes,
    loss_bytes_per_token,
    op_policy_items,
    quad_fwd_bytes,
    recompute_fractions,
    state_bytes_per_param,
)
from workbench.plan.cost.shapes import Linear, ModelShape, fp8_operand_elems
from workbench.plan.cost.software import Software as Software

Arrays = dict[str, np.ndarray]
# Adam step traffic per parameter: read+write fp32 master (8), m (8), v (8), read the fp32
# gradient (4), write the 16-bit working copy (2), zero the gradient (4) -> bytes moved.
OPTIMIZER_BYTES_PER_PARAM = 34.0
TIME_TERMS = ("time_fwd_s", "time_bwd_s", "time_recompute_s", "time_tp_comm_s", "time_cp_comm_s",
              "time_pp_p2p_s", "time_pp_bubble_s", "time_dp_comm_exposed_s", "time_optimizer_s")
MEM_TERMS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes",
             "mem_activations_bytes", "mem_buffers_bytes", "mem_fixed_bytes")


def _g(d: np.ndarray | float, half: float) -> np.ndarray:
    """Fraction of GEMM efficiency kept at dimension d (tile/wave quantization)."""
    return d / (d + half)


def attn_bwd_factor(sw: Software) -> float:
    """Backward over forward attention time: flash backward recomputes the scores (2.5)."""
    return 2.5 if sw.flash_attention else 2.0


def ring_attention_factor(cp: np.ndarray, s: float, sw: Software, co: Coefficients
                          ) -> np.ndarray:
    """Attention time with context parallelism relative to the same FLOPs in one kernel.

    Ring attention runs one kernel per ring step on a KV chunk of s/cp tokens (s/2cp halves with
    load balancing), and a fused kernel's efficiency falls on short sequences (fixed prologue,
    softmax rescaling and tail tiles: chunk / (chunk + ring_chunk_half), relative to the whole
    sequence). Without load balancing the causal mask leaves rank i with i+1 blocks while every
    ring step waits for the slowest rank: (2cp-1)/cp times the balanced time."""
    chunk = s / (cp * (2.0 if sw.cp_load_balance else 1.0))
    kernel = _g(s, co.ring_chunk_half) / _g(chunk, co.ring_chunk_half)
    imbalance = 1.0 if sw.cp_load_balance else (2 * cp - 1) / cp
    return np.where(cp > 1, kernel * imbalance, 1.0)


@dataclass(frozen=True)
class Setup:
    """What every part reads: the layout columns and what they imply on one rank."""

    a: Columns
    dps: np.ndarray  # the parameter-sharding group: dp_shard (x cp where Software says so)
    dpr: np.ndarray  # the gradient all-reduce group: dp_replicate (x cp in Megatron-Core)
    dpr_stride: np.ndarray  # its ranks' distance: tp when CP ranks joined it (next to TP)
    tok: np.ndarray  # tokens of one micro-batch on one rank (GEMM rows)
    ls: np.ndarray  # layers on the fullest pipeline rank
    ranks: tuple[np.ndarray, np.ndarray, np.ndarray]  # layers on the first, a middle, the last
    vv: np.ndarray  # virtual stages the schedule interleaves (1 unless interleaved)
    g_tok: np.ndarray  # GEMM efficiency kept at tok rows
    act: Arrays  # activation bytes per token and layer (activation_bytes_per_token)
    full_frac: np.ndarray  # share of layers fully recomputed (recompute_fractions)
    sel_attn: np.ndarray  # 1 where only the attention core is recomputed
    op: np.ndarray  # 1 where the op policy (selective_op) checkpoints every layer
    op_items: tuple[float, np.ndarray]  # its GEMM share redone, bytes kept per token and layer
    peak: float  # dense FLOP/s in the compute precision
    sms: float  # SMs GEMM tiles are quantized over (0: the smooth mm_dim_half curve instead)
    hbm: float  # achieved HBM bytes/s
    traffic: float  # elementwise HBM round trips per stored activation byte (TP-split part)
    traffic_rep: float  # the same for the replicated part (norms, residual adds)


def setup(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, a: Columns) -> Setup:
    tok = a["mb"] * float(ms.seq_len) / a["cp"]
    ranks = stages.rank_layers(ms.n_layers, a["pp"], a["v"], a["lf"], a["ll"], a["lm"])
    ls = np.maximum(np.maximum(ranks[0], ranks[1]), ranks[2])
    full_frac, sel_attn, op = recompute_fractions(a["rc"], sw)
    act = activation_bytes_per_token(ms, sw, a["tp"], a["sp"])
    traffic, traffic_rep = (co.elem_traffic * (co.compile_elem_factor if sw.compiled else f
                                               if sw.eager else 1.0)
                            for f in (co.eager_elem_factor, 1.0 if sw.norm_kernel
                                      else co.eager_rep_factor))
    cp_shard = a["cp"] if sw.cp_shards_params else 1.0
    dps, dpr = a["dps"] * cp_shard, a["dpr"] * (a["cp"] / cp_shard)
    return Setup(a=a, dps=dps, dpr=dpr, tok=tok, ls=ls, ranks=ranks,
                 dpr_stride=a["tp"] * np.where(dpr > a["dpr"], 1.0, dps),
                 vv=np.where(a["sched"] == Schedule.INTERLEAVED_1F1B, a["v"], 1.0),
                 g_tok=_g(tok, co.mm_dim_half),
                 act=act, full_frac=full_frac, sel_attn=sel_attn, op=op,
                 op_items=op_policy_items(ms, sw, act, a["tp"], a["sp"]),
                 peak=hw.peak_fp32_flops if sw.precision == "fp32" else hw.peak_bf16_flops,
                 sms=hw.sm_count * (co.gemm_tile_waves > 0),
                 hbm=hw.hbm_bw_bytes_per_s * co.hbm_eff, traffic=traffic,
                 traffic_rep=traffic_rep)


@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch on one rank: per layer (mm, attn, elem, quad_elem, layer_f,
    layer_b) and for the LM head and loss of the last stage (head, loss)."""

    mm: np.ndarray  # forward GEMMs
    attn: np.ndarray  # forward attention core
    elem: np.ndarray  # forward elementwise kernels (HBM bound)
    quad_elem: np.ndarray  # the part of elem on the attention core's own tensors
    layer_f: np.ndarray  # whole forward of a layer
    layer_b: np.ndarray  # whole backward of a layer
    head: np.ndarray  # LM head GEMM (forward)
    loss: np.ndarray  # loss elementwise (forward)


def _gemm_s(linears: tuple[Linear, ...], x: Setup, co: Coefficients, sw: Software
            ) -> np.ndarray:
    """Forward GEMM time of one block: tensor-core time at the shape's efficiency, but never
    less than streaming its operands and output through HBM once (roofline, Williams et
    al. 2009). A narrow per-rank GEMM (a GQA K/V projection under TP8: 128 columns; a
    low-rank factor) has ~n FLOPs per byte, under the ridge of an H100 (~290 FLOP/B at
    2.4 TB/s), so its time is set by bandwidth, not by FLOPs. Backward GEMMs (dX, dW)
    move the same operand and output sizes, so 2x forward stays right for them too."""
    tp, tok, e = x.a["tp"], x.tok, sw.act_bytes
    mm_speed = 1.0 if sw.precision != "fp8" else co.fp8_te_mm_speedup \
        if sw.fp8_scaling == "te_delayed" else co.fp8_mm_speedup
    op_bytes = 1.0 if sw.precision == "fp8" else e  # GEMM operand bytes (FP8: cast operands)
    t = 0.0
    for m, n, col in linears:
        m_l, n_l = (m, n / tp) if col else (m / tp, n)
        fill = tile_fill(tok, n_l, x.sms) if x.sms else x.g_tok * _g(np.minimum(m_l, n_l),
                                                                        co.mm_dim_half)
        eff = co.mm_eff_max * fill * mm_speed
        compute = 2.0 * tok * m_l * n_l / (x.peak * eff)
        stream = (op_bytes * (tok * m_l + m_l * n_l) + e * tok * n_l) / x.hbm
        t = t + np.maximum(compute, stream)
    return t


def compute(ms: ModelShape, co: Coefficients, sw: Software, x: Setup) -> Compute:
    """GEMMs of one block (dense and factorized blocks averaged by their share), attention,
    elementwise traffic, and the LM head and loss (kept in BF16 even in FP8 recipes)."""
    tp, cp, tok, s, hbm, peak = x.a["tp"], x.a["cp"], x.tok, float(ms.seq_len), x.hbm, x.peak
    f_lr = ms.lowrank_layers / ms.n_layers
    mm_f = _gemm_s(ms.dense, x, co, sw) * (1 - f_lr)
    if f_lr > 0:
        mm_f = mm_f + _gemm_s(ms.lowrank, x, co, sw) * f_lr
    attn_flops = 4.0 * tok * s * ms.q_width / tp  # counted without the causal saving
    if sw.flash_attention:  # the causal mask lets a fused kernel skip half the tiles
        attn_f = 0.5 * attn_flops / (peak * co.flash_eff
                                     * (co.flash1_rel_speed if sw.flash_v1 else 1.0))
    else:  # batched GEMMs with K = head_dim
        attn_f = attn_flops / (peak * co.mm_eff_max * x.g_tok * _g(ms.head_dim, co.mm_dim_half))
    if not sw.cp_allgather:
        attn_f = attn_f * ring_attention_factor(cp, s, sw, co) \
            + (cp - 1) * co.ring_merge_bytes * tok * ms.q_width / tp / hbm
    act, quad_b = x.act, quad_fwd_bytes(ms, sw, tp, x.traffic * x.act["quad"])  # s*s, per token
    elem_f = tok * (x.traffic_rep * act["rep"] + x.traffic * act["split"] + quad_b) / hbm
    if sw.precision == "fp8" and sw.fp8_scaling == "rowwise":  # per-operand amax + cast kernels
        elem_f = elem_f + co.fp8_rowwise_cast_bytes * tok * fp8_operand_elems(ms, tp) / hbm
    head_f = 2 * tok * float(ms.hidden) * ms.vocab / tp / (
        peak * co.mm_eff_max * x.g_tok * _g(ms.vocab / tp, co.mm_dim_half))
    loss_tp = 1.0 if sw.gathered_logits else tp  # the loss sees 1/tp of the vocabulary or all
    return Compute(mm=mm_f, attn=attn_f, elem=elem_f,
                   quad_elem=tok * quad_b / hbm,
                   layer_f=mm_f + attn_f + elem_f + co.kernel_overhead_s,
                   layer_b=2 * mm_f + attn_bwd_factor(sw) * attn_f + 2 * elem_f
                   + 2 * co.kernel_overhead_s, head=head_f,
                   loss=sw.loss_fwd_bytes_per_logit(x.traffic) * tok * ms.vocab / loss_tp / hbm)


@dataclass(frozen=True)
class Communication:
    """Exposed seconds of one layer and micro-batch on one rank."""

    tp: np.ndarray  # tensor / sequence parallel collectives of one pass
    cp_fwd: np.ndarray  # context parallel K/V exchange, forward
    cp_bwd: np.ndarray  # context parallel K/V and dK/dV exchange, backward


def communication(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, x: Setup,
                  c: Compute) -> Communication:
    """Tensor / sequence parallel and context parallel traffic of one layer."""
    tp, cp, sp, tok, e = x.a["tp"], x.a["cp"], x.a["sp"], x.tok, sw.act_bytes
    bw_tp, lat_tp = collective_link(tp, 1, hw, co)
    # SP: 2 all-gathers + 2 reduce-scatters a pass; FP8 tensorwise gathers travel in 1 byte
    fp8_ag = sw.precision == "fp8" and sw.fp8_scaling == "tensorwise"
    vol = tok * float(ms.hidden) * e * np.where((sp > 0) & fp8_ag, 0.75, 1.0)
    tp_f = np.where(tp > 1, 4 * (tp - 1) / tp * vol / bw_tp
                    + np.where(sp > 0, 4, 2) * lat_tp, 0.0) \
        * (1 - (co.async_tp_overlap if sw.async_tp else co.tp_overlap if sw.overlap_tp else 0.0))
    if sw.batch_first_sp and not sw.async_tp:  # 4 collectives, each a read + write of vol
        tp_f = tp_f + np.where((tp > 1) & (sp > 0) & (x.a["mb"] > 1), 8 * vol / x.hbm, 0.0)
    # ring attention: each of cp-1 steps sends this rank's K/V block to the next rank while the
    # current block is computed; only what the step's attention cannot cover is exposed
    bw_cp, lat_cp = collective_link(cp, tp, hw, co)
    kv_step = tok * 2 * ms.kv_width / tp * e / bw_cp + lat_cp / np.maximum(cp, 2)
    attn_step = c.attn / np.maximum(cp, 1)

    def ring_exposed(comm: np.ndarray, comp: np.ndarray) -> np.ndarray:
        return np.where(cp > 1, (cp - 1) * np.maximum(comm * (1 - co.cp_overlap), comm - comp),
                        0.0)

    if sw.cp_allgather:  # (cp-1) blocks in, nothing to hide behind; dK/dV the same way back
        cp_fwd = cp_bwd = (cp - 1) * kv_step
    else:
        cp_fwd = ring_exposed(kv_step, attn_step)
        cp_bwd = ring_exposed(2 * kv_step, attn_bwd_factor(sw) * attn_step)  # K/V and dK/dV
    return Communication(tp=tp_f, cp_fwd=cp_fwd, cp_bwd=cp_bwd)


@dataclass(frozen=True)
class Stage:
    """One micro-batch of the slowest pipeline rank (seconds), and what its parameters cost."""

    fwd: np.ndarray
    bwd: np.ndarray
    rec: np.ndarray  # recomputation
    tp: np.ndarray  # tensor parallel: forward, backward (same volume: Megatron f/g), recompute
    cp: np.ndarray  # forward ring (and its recompute), backward ring
    p2p: np.ndarray  # activations to / from the neighbouring stages
    per_mb: np.ndarray  # all of the above
    p_layer: float  # parameters of one (mean) layer
    p_mp: np.ndarray  # parameters of one model-parallel shard (the fullest rank's)
    p_ranks: tuple[np.ndarray, np.ndarray, np.ndarray]  # the same on the first, middle, last
    w_bytes: float  # bytes of a working weight
    gather: tuple[float, float]  # bytes per parameter an FSDP gather moves: model, one block


def stage(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, x: Setup, c: Compute,
          m: Communication) -> Stage:
    """The terms of the pipeline rank with the longest micro-batch (workbench.plan.stages)."""
    a, full_frac, e, pp = x.a, x.full_frac, sw.act_bytes, x.a["pp"]
    f_l = c.mm + c.attn + c.elem + co.kernel_overhead_s
    core = c.attn + c.quad_elem
    # the op policy redoes its GEMM share and the elementwise ops, an eager core but not a fused one
    op_l = x.op_items[0] * c.mm + c.elem + co.kernel_overhead_s \
        + (-c.quad_elem if sw.flash_attention else c.attn)
    rec_l = full_frac * c.layer_f + x.sel_attn * core + x.op * op_l
    # m.tp is one pass's 2 collectives; the backward's count without SP is the stack's
    bwd_tp = np.where(a["sp"] > 0, 1.0, sw.tp_bwd_allreduces(ms.gated_mlp) / 2.0)
    # the op policy redoes the SP all-gathers (half of a pass's TP traffic), keeps reductions
    tp_l = m.tp * (1 + bwd_tp + full_frac + 0.5 * x.op * (a["sp"] > 0))
    cp_l = m.cp_fwd * (1 + full_frac + x.op) + m.cp_bwd
    head = c.head + c.loss
    if sw.gathered_logits:  # all-gather of the 16-bit logits over the TP group (forward)
        bw_tp, _ = collective_link(a["tp"], 1, hw, co)
        head = head + np.where(a["tp"] > 1, (a["tp"] - 1) / a["tp"] * x.tok * ms.vocab * e
                               / bw_tp, 0.0)
    emb = x.traffic * x.tok * x.act["input"] / x.hbm  # the lookup's rows, written once
    t_fwd, t_bwd, t_rec, t_tp, t_cp = stages.stage_times(
        x.ranks, pp, (f_l, c.layer_b, rec_l, tp_l, cp_l), emb, head)
    bw_pp = group_bw(2, a["tp"] * x.dpr * x.dps, hw, co)  # neighbours one stage apart
    split = np.where(sw.p2p_tp_split | (a["sp"] > 0), a["tp"], 1.0)  # Software.p2p_tp_split
    p2p_bytes = x.tok * float(ms.hidden) * e / split
    transfers = np.where(pp > 2, 4.0, 2.0) if sw.p2p_blocking else 2.0  # Software.p2p_blocking
    t_p2p = np.where(a["pp"] > 1, transfers * x.vv * (p2p_bytes / bw_pp + co.p2p_latency_s), 0.0)
    p_layer = ms.mean_layer_params()
    p_ranks, p_mp = stages.rank_params(x.ranks, pp, p_layer, ms.embed_params, ms.head_params,
                                       a["tp"])
    w_bytes = 4.0 if sw.precision == "fp32" else 2.0
    return Stage(fwd=t_fwd, bwd=t_bwd, rec=t_rec, tp=t_tp, cp=t_cp, p2p=t_p2p,
                 per_mb=t_fwd + t_bwd + t_rec + t_tp + t_cp + t_p2p, p_layer=p_layer,
                 p_mp=p_mp, p_ranks=p_ranks, w_bytes=w_bytes,
                 gather=gather_bytes(ms, sw, w_bytes))


def data_parallel(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, x: Setup,
                  st: Stage) -> tuple[np.ndarray, np.ndarray]:
    """(total, exposed) seconds of data-parallel traffic in one step: DDP all-reduce once a
    step; FSDP gathers + reduce-scatter per micro-batch, except inside a pipeline, where they
    happen once a step (`stages.fsdp_once`)."""
    tp, dpr, dps, ga, ls = x.a["tp"], x.dpr, x.dps, x.a["ga"], x.ls
    dp_elems = st.p_mp * ms.dp_bytes_ratio
    ov = co.dp_overlap if sw.overlap_dp else 0.0
    bw_dps, lat_dps = collective_link(dps, tp, hw, co)
    ov_fsdp = ov
    if sw.dp_stack == "deepspeed_zero3":  # flat gathers: one NIC per GPU, no rail aggregation
        nic = hw.inter_node_gbps * co.link_eff_inter * co.zero3_gather_eff * 1e9
        bw_dps = np.where(dps * tp <= hw.gpus_per_node, bw_dps, nic)
        ov_fsdp = co.zero3_overlap
    s_per_b, lat = dp_elems * (dps - 1) / dps / bw_dps, lat_dps * (ls + 1)
    ag_s, rs_s = s_per_b * st.gather[0] + lat, s_per_b * sw.grad_reduce_bytes + lat
    fsdp_mb = np.where(dps > 1, 2 * ag_s + rs_s, 0.0)  # gathered for forward and backward
    fsdp_exposed = np.maximum(fsdp_mb * (1 - ov_fsdp), fsdp_mb - (st.fwd + st.bwd + st.rec))
    once, once_exposed = stages.fsdp_once(ag_s, rs_s, st.fwd, st.bwd, x.vv, ov_fsdp)
    in_pipe = (x.a["pp"] > 1) & (dps > 1)
    fsdp_total = np.where(in_pipe, once, ga * fsdp_mb)
    fsdp_exposed = np.where(in_pipe, once_exposed, ga * fsdp_exposed)
    bw_dpr, lat_dpr = collective_link(dpr, x.dpr_stride, hw, co)
    ddp_elems = np.where(dpr > 1, (dpr - 1) / dpr * dp_elems / dps / bw_dpr, 0.0)
    ddp_lat = np.where(dpr > 1, lat_dpr, 0.0)
    if sw.dist_optimizer:  # reduce-scatter behind the last backward, gather behind a forward
        rs = ddp_elems * sw.grad_reduce_bytes * (2.0 if sw.zero1_allreduce else 1.0) + ddp_lat
        ag = ddp_elems * st.w_bytes + ddp_lat
        ddp = rs + ag
        ddp_exposed = np.maximum(rs * (1 - ov), rs - st.bwd) + np.maximum(ag * (1 - ov),
                                                                         ag - st.fwd)
    else:
        ddp = 2 * ddp_elems * sw.grad_reduce_bytes + ddp_lat
        ddp_exposed = np.maximum(ddp * (1 - ov), ddp - st.bwd)
    return fsdp_total + ddp, fsdp_exposed + ddp_exposed


def memory(ms: ModelShape, co: Coefficients, sw: Software, x: Setup, st: Stage) -> Arrays:
    """MEM_TERMS of one GPU of the fullest pipeline rank, and `inflight_layers` (layer
    activations the schedule keeps alive at once)."""
    a, dps, tok, e, act, full_frac = x.a, x.dps, x.tok, sw.act_bytes, x.act, x.full_frac
    tp, pp, ga, w_bytes = a["tp"], a["pp"], a["ga"], st.w_bytes
    param_b, grad_b, opt_b = state_bytes_per_param(sw, dps, x.dpr, w_bytes)
    kv_others = tok * (a["cp"] - 1) * 2 * ms.kv_width / tp * e if sw.cp_allgather else 0.0
    # A compiled block (Inductor's min-cut partitioner) recomputes fused pointwise ops in the
    # backward instead of saving their outputs: the two norm outputs and the SwiGLU product.
    unsaved = (2 * act["input"] + e * ms.ffn_hidden / tp * ms.gated_mlp) if sw.compiled else 0.0
    per_layer = tok * (act["rep"] + act["split"] + act["unfused"]
                       + (1 - x.sel_attn) * act["quad"]) + kv_others - tok * unsaved
    full_layer = tok * (act["rep"] + act["split"] + act["unfused"] + act["quad"]) + kv_others
    stored = tok * (full_frac * act["input"] + x.op * x.op_items[1]) \
        + (1 - full_frac - x.op) * per_layer
    # one layer re-materialized at a time (under the op policy, what it did not keep)
    working = np.where(full_frac > 0, full_layer,
                       x.op * np.maximum(full_layer - tok * x.op_items[1], 0.0))
    factor, factor_mid = stages.inflight_per_layer(
        pp, ga, a["sched"] == Schedule.GPIPE, a["sched"] == Schedule.INTERLEAVED_1F1B, x.vv,
        float(sw.pp_group))
    logits = tok * loss_bytes_per_token(ms.vocab, sw, tp, ga)  # last stage
    # FSDP2 gathers one block at a time; inside a pipeline schedule it neither reshards after
    # forward nor syncs gradients until the last micro-batch (torch.distributed.pipelining sets
    # reshard_after_backward / requires_gradient_sync False), so the stage's unsharded weights
    # and fp32 gradient accumulators stay allocated for the whole step.
    g_model, g_block = st.gather
    fsdp_per_p = np.where((dps > 1) & (pp > 1), g_model + 4.0, 0.0)
    fsdp_flat = np.where((dps > 1) & (pp == 1), max(
        (2 * g_block + 4.0) * st.p_layer, (2 * w_bytes + 4.0) * ms.vocab * float(ms.hidden)
    ) / tp, 0.0)
    # Pipeline send/recv: one boundary activation in and one out (Megatron splits it over TP).
    p2p_buf = np.where(pp > 1, 2.0 * tok * float(ms.hidden) * e / tp, 0.0)
    logits_first = np.where(pp > 1, 0.0, logits)
    out = stages.rank_memory(x.ranks, st.p_ranks, (factor, factor_mid, 1.0), stored,
                             (logits_first + fsdp_flat + working + p2p_buf, working + p2p_buf,
                              logits + working + p2p_buf), fsdp_per_p,
                             {"mem_params_bytes": param_b, "mem_grads_bytes": grad_b,
                              "mem_optimizer_bytes": opt_b}, co.mem_fixed_bytes, co.mem_frag,
                             pp)
    rank = out.pop("peak_rank")  # the parts of mem_buffers_bytes and mem_fixed_bytes: --explain
    logits_buf = np.where(rank == 2, logits, np.where(rank == 0, logits_first, 0.0))
    peak = out["mem_activations_bytes"] + out["mem_buffers_bytes"]
    return out | {"mem_buf_logits_bytes": logits_buf,
                  "mem_buf_fsdp_bytes": out["mem_buffers_bytes"] - logits_buf - working - p2p_buf,
                  "mem_buf_recompute_layer_bytes": working + 0.0 * tok,
                  "mem_buf_p2p_bytes": p2p_buf, "mem_fragmentation_bytes": co.mem_frag * peak,
                  "mem_peak_rank": rank}


def evaluate(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, a: Columns,
             global_batch: float) -> Arrays:
    """All time and memory terms (TIME_TERMS, MEM_TERMS, their sums step_time_s and
    peak_mem_bytes, time_dp_comm_overlapped_s, stage_micro_batch_s, inflight_layers) for the
    layouts in `a`, which has its grad_accum column `ga`; see the module docstring."""
    x = setup(ms, hw, co, sw, a)
    c = compute(ms, co, sw, x)
    st = stage(ms, hw, co, sw, x, c, communication(ms, hw, co, sw, x, c))
    dp_total, dp_exposed = data_parallel(ms, hw, co, sw, x, st)
    ga, per_mb = a["ga"], st.per_mb
    out: Arrays = {
        "time_fwd_s": ga * st.fwd, "time_bwd_s": ga * st.bwd, "time_recompute_s": ga * st.rec,
        "time_tp_comm_s": ga * st.tp, "time_cp_comm_s": ga * st.cp, "time_pp_p2p_s": ga * st.p2p,
        "time_pp_bubble_s": (a["pp"] - 1) / x.vv * per_mb,
        "time_dp_comm_exposed_s": dp_exposed,
        "time_optimizer_s": OPTIMIZER_BYTES_PER_PARAM * st.p_mp / x.hbm
        / (x.dps * (x.dpr if sw.dist_optimizer else 1.0)),
    }
    out["step_time_s"] = sum(out[k] for k in TIME_TERMS)
    out["time_dp_comm_overlapped_s"] = dp_total - dp_exposed
    out.update(memory(ms, co, sw, x, st))
    out["peak_mem_bytes"] = sum(out[k] for k in MEM_TERMS)
    out["stage_micro_batch_s"] = per_mb
    return out
