"""The cost model's formulas, written once over numpy arrays of layouts.

`estimate()` evaluates them on one layout and `search` on millions at once, so the exhaustive
ranking and the single prediction can never disagree. Every array holds one value per layout;
model and hardware figures are scalars. Times are per optimizer step on one GPU of the slowest
pipeline stage; memory is per GPU of the fullest stage.

Layout array names: dpr dps tp pp cp sp (0/1) mb ga rc (0 none, 1 selective, 2 full)
sched (0 gpipe, 1 1f1b, 2 interleaved) v.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.plan.coefficients import Coefficients
from workbench.plan.hardware import GpuSpec
from workbench.plan.shapes import ModelShape

Arrays = dict[str, np.ndarray]
# Adam step traffic per parameter: read+write fp32 master (8), m (8), v (8), read the fp32
# gradient (4), write the 16-bit working copy (2), zero the gradient (4) -> bytes moved.
OPTIMIZER_BYTES_PER_PARAM = 34.0


@dataclass(frozen=True)
class Software:
    """What the training stack does, as far as cost goes (not a coefficient: a fact of the code).

    precision: fp32 | bf16 | fp16 | fp8 (fp8 = FP8 linears, BF16 elsewhere).
    flash_attention: fused attention (no s*s tensors stored or moved); Megatron 2021 had none.
    dropout: dropout masks are stored (GPT-era Megatron); Llama recipes train without dropout.
    overlap_dp: gradient reduction / FSDP gathers are overlapped with compute.
    grad_reduce_bytes: bytes per gradient element on the wire (fp32 reduce = 4, fp16 = 2).
    Parameters are sharded over dp_shard x cp (context-parallel ranks hold the same weights and
    reduce their gradients together, as torchtitan's dp_shard_cp mesh does).
    """

    precision: str = "bf16"
    flash_attention: bool = True
    dropout: bool = False
    overlap_dp: bool = True
    grad_reduce_bytes: float = 4.0
    overlap_tp: bool = False  # Megatron --tp-comm-overlap (TE userbuffers)
    async_tp: bool = False  # torchtitan async TP (SymmetricMemory micro-pipelining)
    # Megatron distributed optimizer with --overlap-param-gather: gradients reduce-scattered
    # (overlapping the last backward), parameters all-gathered in 16 bit (overlapping the next
    # forward) instead of one all-reduce.
    dist_optimizer: bool = False
    compiled: bool = False  # torch.compile / fused kernels: fewer elementwise HBM round trips
    # PyTorch eager elementwise ops (one kernel per op, FP32 upcasts in norms/RoPE); False: the
    # fused kernels of Megatron/Transformer Engine (or compiled, see above).
    eager: bool = False
    # FP8 scaling granularity (torchao): "tensorwise" (one scale per tensor; the producer's
    # kernel fuses amax and cast, and TP all-gathers travel in FP8) or "rowwise" (one scale per
    # row: separate amax/cast kernels per operand and axis, TP all-gathers stay in BF16).
    fp8_scaling: str = "tensorwise"
    # Which implementation shards parameters over dp_shard: "fsdp" (PyTorch FSDP/FSDP2,
    # Megatron distributed optimizer: bucketed NCCL collectives over all NICs of a node, prefetch
    # one block ahead) or "deepspeed_zero3" (DeepSpeed ZeRO-3 as of 2021: flat per-parameter
    # gathers, see Coefficients.zero3_gather_eff).
    dp_stack: str = "fsdp"
    # Context parallel shards the sequence in 2*cp chunks, chunk i paired with 2*cp-1-i, so every
    # rank does the same causal work (torchtitan / Megatron-Core default); False: naive ring.
    cp_load_balance: bool = True
    # Context parallel by one all-gather of K/V per layer (Llama 3; this repository's engine,
    # train/context.py) instead of a ring: attention is one kernel over the whole sequence, the
    # gather (forward) and reduce-scatter of dK/dV (backward) are not overlapped, and the
    # gathered K/V of the other cp ranks stay stored for the backward.
    cp_allgather: bool = False
    # Activations laid out (batch, seq, hidden) with sequence parallel sharding dim 1
    # (torchtitan, this engine) rather than Megatron's sequence-first layout: with more than one
    # sequence per micro-batch, each all-gather's output and each reduce-scatter's input is
    # re-laid out by a full copy (torch.distributed._functional_collectives chunk + cat), unless
    # async TP's fused all-gather/reduce-scatter matmuls move the shards themselves.
    batch_first_sp: bool = False

    @property
    def act_bytes(self) -> float:
        return 4.0 if self.precision == "fp32" else 2.0


def _g(d: np.ndarray | float, half: float) -> np.ndarray:
    """Fraction of GEMM efficiency kept at dimension d (tile/wave quantization)."""
    return d / (d + half)


def _rails(size: np.ndarray, stride: np.ndarray, hw: GpuSpec) -> np.ndarray:
    """Members of a group that share a node: a group spanning nodes runs one ring per member
    (rail), each over its own NIC, so cross-node bandwidth adds up across them (NCCL)."""
    return np.clip(hw.gpus_per_node / np.maximum(stride, 1), 1, np.maximum(size, 1))


def _bw(size: np.ndarray, stride: np.ndarray, hw: GpuSpec, co: Coefficients) -> np.ndarray:
    """Bytes/s of a group of `size` ranks `stride` apart: NVLink when it fits in one node, else
    the NICs of the members on one node together, never more than NVLink."""
    intra_bw = hw.intra_node_gbps * co.link_eff_intra
    inter_bw = np.minimum(hw.inter_node_gbps * co.link_eff_inter * _rails(size, stride, hw),
                          intra_bw)
    return np.where(size * stride <= hw.gpus_per_node, intra_bw, inter_bw) * 1e9


def _lat(size: np.ndarray, stride: np.ndarray, hw: GpuSpec, co: Coefficients) -> np.ndarray:
    intra = size * stride <= hw.gpus_per_node
    per = np.where(intra, co.coll_latency_intra_s, co.coll_latency_inter_s)
    return np.where(size > 1, per * (1.0 + np.log2(np.maximum(size, 1))), 0.0)


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


def fp8_operand_elems(ms: ModelShape, tp: np.ndarray) -> np.ndarray:
    """Elements per token of every FP8 linear's input and output(-gradient) on one TP rank:
    what rowwise scaling reads, reduces and casts once per pass (column-parallel linears see
    the gathered input, row-parallel ones the full output before its reduce-scatter)."""
    total = 0.0
    for m, n, col in ms.dense:
        total = total + (m + n / tp if col else m / tp + n)
    return total


def activation_bytes_per_token(ms: ModelShape, sw: Software, tp: np.ndarray, sp: np.ndarray
                               ) -> dict[str, np.ndarray]:
    """Korthikanti et al. (2022) itemization per token and layer, generalized to GQA/SwiGLU:
    'rep' is replicated across TP ranks unless sequence parallel, 'split' is divided by TP,
    'quad' is the s*s attention part (softmax, its dropout) that selective recompute drops."""
    e, h = sw.act_bytes, ms.hidden
    mask = 1.0 if sw.dropout else 0.0
    rep = e * h * 4 + 2 * h * mask  # 2 norm inputs, qkv input, mlp input; 2 dropout masks
    split = e * (2 * ms.q_width + 2 * ms.kv_width) + e * ms.ffn_hidden * (3 if ms.gated_mlp else 2)
    if sw.flash_attention:
        quad = 4.0 * ms.n_heads  # logsumexp statistics only
    else:
        quad = ms.n_heads * ms.seq_len * (e + mask * (1 + e))
    rep_div = np.where(sp > 0, tp, 1.0)
    return {"rep": rep / rep_div, "split": split / tp, "quad": quad / tp, "input": e * h / rep_div}


def recompute_fractions(rc: np.ndarray, sw: Software) -> tuple[np.ndarray, np.ndarray]:
    """(share of layers fully checkpointed, 1 where only the attention core is recomputed).

    full: every layer keeps only its input (Korthikanti "full"). selective: without fused
    attention, Korthikanti's selective recompute of the s*s attention core; with fused attention
    there is no s*s tensor to drop, so selective means checkpointing every other layer
    (torchtitan's selective layer policy, ac_freq=2)."""
    if sw.flash_attention:
        return np.where(rc == 2, 1.0, np.where(rc == 1, 0.5, 0.0)), np.zeros_like(rc)
    return np.where(rc == 2, 1.0, 0.0), np.where(rc == 1, 1.0, 0.0)


def evaluate(ms: ModelShape, hw: GpuSpec, co: Coefficients, sw: Software, a: Arrays,
             global_batch: float) -> Arrays:
    """All time and memory terms for the layouts in `a`; see the module docstring."""
    tp, pp, cp, dpr = a["tp"], a["pp"], a["cp"], a["dpr"]
    dps = a["dps"] * cp  # the parameter-sharding group (see Software)
    mb, ga, rc, v = a["mb"], a["ga"], a["rc"], a["v"]
    e, s, h, L = sw.act_bytes, float(ms.seq_len), float(ms.hidden), float(ms.n_layers)
    fp32 = sw.precision == "fp32"
    peak = hw.peak_fp32_flops if fp32 else hw.peak_bf16_flops
    mm_speed = co.fp8_mm_speedup if sw.precision == "fp8" else 1.0
    tok = mb * s / cp  # tokens of one micro-batch on one rank (GEMM rows)
    ls = np.ceil(L / (pp * a["v"])) * a["v"]  # layers on the fullest stage
    g_tok = _g(tok, co.mm_dim_half)

    # --- compute: GEMMs of one block (dense and factorized blocks averaged by their share) ---
    hbm = hw.hbm_bw_bytes_per_s * co.hbm_eff
    op_bytes = 1.0 if sw.precision == "fp8" else e  # GEMM operand bytes (FP8: cast operands)

    def block_mm_s(linears) -> np.ndarray:
        """Forward GEMM time of one block: tensor-core time at the shape's efficiency, but never
        less than streaming its operands and output through HBM once (roofline, Williams et
        al. 2009). A narrow per-rank GEMM (a GQA K/V projection under TP8: 128 columns; a
        low-rank factor) has ~n FLOPs per byte, under the ridge of an H100 (~290 FLOP/B at
        2.4 TB/s), so its time is set by bandwidth, not by FLOPs. Backward GEMMs (dX, dW)
        move the same operand and output sizes, so 2x forward stays right for them too."""
        t = 0.0
        for m, n, col in linears:
            m_l, n_l = (m, n / tp) if col else (m / tp, n)
            local = np.minimum(m_l, n_l)
            eff = co.mm_eff_max * g_tok * _g(local, co.mm_dim_half) * mm_speed
            compute = 2.0 * tok * m_l * n_l / (peak * eff)
            stream = (op_bytes * (tok * m_l + m_l * n_l) + e * tok * n_l) / hbm
            t = t + np.maximum(compute, stream)
        return t

    f_lr = ms.lowrank_layers / ms.n_layers
    mm_f = block_mm_s(ms.dense) * (1 - f_lr)
    if f_lr > 0:
        mm_f = mm_f + block_mm_s(ms.lowrank) * f_lr
    attn_flops = 4.0 * tok * s * ms.q_width / tp  # counted without the causal saving
    if sw.flash_attention:  # the causal mask lets a fused kernel skip half the tiles
        attn_f = 0.5 * attn_flops / (peak * co.flash_eff)
    else:  # batched GEMMs with K = head_dim
        attn_f = attn_flops / (peak * co.mm_eff_max * g_tok * _g(ms.head_dim, co.mm_dim_half))
    if not sw.cp_allgather:
        attn_f = attn_f * ring_attention_factor(cp, s, sw, co) \
            + (cp - 1) * co.ring_merge_bytes * tok * ms.q_width / tp / hbm
    act = activation_bytes_per_token(ms, sw, tp, a["sp"])
    traffic = co.elem_traffic * (co.compile_elem_factor if sw.compiled
                                 else co.eager_elem_factor if sw.eager else 1.0)
    elem_f = traffic * tok * (act["rep"] + act["split"] + act["quad"]) / hbm
    if sw.precision == "fp8" and sw.fp8_scaling == "rowwise":  # per-operand amax + cast kernels
        elem_f = elem_f + co.fp8_rowwise_cast_bytes * tok * fp8_operand_elems(ms, tp) / hbm
    quad_elem_f = traffic * tok * act["quad"] / hbm
    layer_f = mm_f + attn_f + elem_f + co.kernel_overhead_s
    attn_bwd = attn_bwd_factor(sw)
    layer_b = 2 * mm_f + attn_bwd * attn_f + 2 * elem_f + 2 * co.kernel_overhead_s

    # --- tensor / sequence and context parallel communication per layer ---
    bw_tp, lat_tp = _bw(tp, 1, hw, co), _lat(tp, 1, hw, co)
    # SP: 2 all-gathers + 2 reduce-scatters a pass; FP8 tensorwise gathers travel in 1 byte
    fp8_ag = sw.precision == "fp8" and sw.fp8_scaling == "tensorwise"
    vol = tok * h * e * np.where((a["sp"] > 0) & fp8_ag, 0.75, 1.0)
    tp_f = np.where(tp > 1, 4 * (tp - 1) / tp * vol / bw_tp
                    + np.where(a["sp"] > 0, 4, 2) * lat_tp, 0.0) \
        * (1 - (co.async_tp_overlap if sw.async_tp else co.tp_overlap if sw.overlap_tp else 0.0))
    if sw.batch_first_sp and not sw.async_tp:  # 4 collectives, each a read + write of vol
        tp_f = tp_f + np.where((tp > 1) & (a["sp"] > 0) & (mb > 1), 8 * vol / hbm, 0.0)
    # ring attention: each of cp-1 steps sends this rank's K/V block to the next rank while the
    # current block is computed; only what the step's attention cannot cover is exposed
    bw_cp, lat_cp = _bw(cp, tp, hw, co), _lat(cp, tp, hw, co)
    kv_step = tok * 2 * ms.kv_width / tp * e / bw_cp + lat_cp / np.maximum(cp, 2)
    attn_step = attn_f / np.maximum(cp, 1)

    def ring_exposed(comm: np.ndarray, comp: np.ndarray) -> np.ndarray:
        return np.where(cp > 1, (cp - 1) * np.maximum(comm * (1 - co.cp_overlap), comm - comp),
                        0.0)

    if sw.cp_allgather:  # (cp-1) blocks in, nothing to hide behind; dK/dV the same way back
        cp_fwd = cp_bwd = (cp - 1) * kv_step
    else:
        cp_fwd = ring_exposed(kv_step, attn_step)
        cp_bwd = ring_exposed(2 * kv_step, attn_bwd_factor(sw) * attn_step)  # K/V and dK/dV

    # --- recomputation per layer ---
    full_frac, sel_attn = recompute_fractions(rc, sw)

    # --- LM head and loss on the last stage (kept in BF16 even in FP8 recipes) ---
    head_f = 2 * tok * h * ms.vocab / tp / (peak * co.mm_eff_max * g_tok
                                             * _g(ms.vocab / tp, co.mm_dim_half))
    loss_elem = traffic * tok * 4.0 * ms.vocab / tp / hbm

    t_fwd = ls * (mm_f + attn_f + elem_f + co.kernel_overhead_s) + head_f + loss_elem
    t_bwd = ls * layer_b + 2 * head_f + 2 * loss_elem
    t_rec = ls * (full_frac * layer_f + sel_attn * (attn_f + quad_elem_f))
    t_tp = ls * tp_f * (2 + full_frac)  # fwd, bwd (same volume: Megatron f/g), recompute
    t_cp = ls * (cp_fwd * (1 + full_frac) + cp_bwd)  # fwd (and its recompute) ring, bwd ring

    # --- pipeline: p2p of activations at stage boundaries, and the bubble ---
    stride_pp = tp * dpr * dps
    bw_pp = _bw(2, stride_pp, hw, co)  # neighbours one stage apart
    p2p_bytes = tok * h * e / tp  # Megatron scatter/gather splits the boundary over TP
    vv = np.where(a["sched"] == 2, v, 1.0)
    t_p2p = np.where(pp > 1, 2 * vv * (p2p_bytes / bw_pp + co.p2p_latency_s), 0.0)
    per_mb = t_fwd + t_bwd + t_rec + t_tp + t_cp + t_p2p
    bubble = (pp - 1) / vv * per_mb

    # --- data parallel: DDP all-reduce once a step, FSDP gathers + reduce-scatter per micro-batch
    emb_stage = np.where(pp > 1, max(ms.embed_params, ms.head_params),
                         ms.embed_params + ms.head_params)
    p_layer = ms.mean_layer_params()
    p_mp = (ls * p_layer + emb_stage) / tp  # parameters of one model-parallel shard
    dp_elems = p_mp * ms.dp_bytes_ratio
    w_bytes = 4.0 if fp32 else 2.0
    ov = co.dp_overlap if sw.overlap_dp else 0.0
    bw_dps, lat_dps = _bw(dps, tp, hw, co), _lat(dps, tp, hw, co)
    ov_fsdp = ov
    if sw.dp_stack == "deepspeed_zero3":  # flat gathers: one NIC per GPU, no rail aggregation
        nic = hw.inter_node_gbps * co.link_eff_inter * co.zero3_gather_eff * 1e9
        bw_dps = np.where(dps * tp <= hw.gpus_per_node, bw_dps, nic)
        ov_fsdp = co.zero3_overlap
    fsdp_mb = np.where(dps > 1, (dps - 1) / dps * dp_elems * (2 * w_bytes + sw.grad_reduce_bytes)
                       / bw_dps + 3 * lat_dps * (ls + 1), 0.0)
    fsdp_exposed = np.maximum(fsdp_mb * (1 - ov_fsdp), fsdp_mb - (t_fwd + t_bwd + t_rec))
    bw_dpr, lat_dpr = _bw(dpr, tp * dps, hw, co), _lat(dpr, tp * dps, hw, co)
    ddp_elems = np.where(dpr > 1, (dpr - 1) / dpr * dp_elems / dps / bw_dpr, 0.0)
    ddp_lat = np.where(dpr > 1, lat_dpr, 0.0)
    if sw.dist_optimizer:  # reduce-scatter behind the last backward, gather behind a forward
        rs, ag = ddp_elems * sw.grad_reduce_bytes + ddp_lat, ddp_elems * w_bytes + ddp_lat
        ddp = rs + ag
        ddp_exposed = np.maximum(rs * (1 - ov), rs - t_bwd) + np.maximum(ag * (1 - ov),
                                                                        ag - t_fwd)
    else:
        ddp = 2 * ddp_elems * sw.grad_reduce_bytes + ddp_lat
        ddp_exposed = np.maximum(ddp * (1 - ov), ddp - t_bwd)
    dp_total = ga * fsdp_mb + ddp
    dp_exposed = ga * fsdp_exposed + ddp_exposed

    opt = OPTIMIZER_BYTES_PER_PARAM * p_mp / dps / hbm

    out: Arrays = {
        "time_fwd_s": ga * t_fwd, "time_bwd_s": ga * t_bwd, "time_recompute_s": ga * t_rec,
        "time_tp_comm_s": ga * t_tp, "time_cp_comm_s": ga * t_cp, "time_pp_p2p_s": ga * t_p2p,
        "time_pp_bubble_s": bubble, "time_dp_comm_exposed_s": dp_exposed,
        "time_optimizer_s": opt + 0.0 * tp,
    }
    out["step_time_s"] = sum(out[k] for k in TIME_TERMS)
    out["time_dp_comm_overlapped_s"] = dp_total - dp_exposed

    # --- memory of the fullest stage ---
    state_per_param = np.where(dps > 1, 16.0 / dps, 16.0 if fp32 else 18.0)
    grad_b = np.where(dps > 1, 4.0 / dps, 4.0)
    param_b = np.where(dps > 1, 4.0 / dps, w_bytes)
    opt_b = state_per_param - grad_b - param_b
    kv_others = tok * (cp - 1) * 2 * ms.kv_width / tp * e if sw.cp_allgather else 0.0
    # A compiled block (Inductor's min-cut partitioner) recomputes fused pointwise ops in the
    # backward instead of saving their outputs: the two norm outputs and the SwiGLU product.
    unsaved = (2 * act["input"] + e * ms.ffn_hidden / tp * ms.gated_mlp) if sw.compiled else 0.0
    per_layer = tok * (act["rep"] + act["split"] + (1 - sel_attn) * act["quad"]) + kv_others \
        - tok * unsaved
    full_layer = tok * (act["rep"] + act["split"] + act["quad"]) + kv_others
    stored = full_frac * tok * act["input"] + (1 - full_frac) * per_layer
    working = np.where(full_frac > 0, full_layer, 0.0)  # one layer re-materialized at a time
    sched = a["sched"]
    inflight = np.where(pp == 1, 1.0, np.where(sched == 0, ga, np.minimum(pp, ga)))
    first_layers = ls * inflight * np.where((sched == 2) & (pp > 1),
                                            1 + (pp - 1) / (pp * vv), 1.0)
    acts = stored * first_layers
    # Eager cross-entropy on fp32 logits (`logits.float()`, as torchtitan and this engine do):
    # at the start of the backward three fp32 tensors of the logits' size are alive at once:
    # the saved log-probabilities, the incoming gradient and the gradient log-softmax returns.
    logits = LOSS_BYTES_PER_LOGIT * tok * ms.vocab / tp  # last stage
    # FSDP2 gathers one block at a time; inside a pipeline schedule it neither reshards after
    # forward nor syncs gradients until the last micro-batch (torch.distributed.pipelining sets
    # reshard_after_backward / requires_gradient_sync False), so the stage's unsharded weights
    # and fp32 gradient accumulators stay allocated for the whole step.
    fsdp_buf = np.where(dps > 1, np.where(pp > 1, (w_bytes + 4.0) * p_mp, (2 * w_bytes + 4.0)
                                          * max(p_layer, ms.vocab * h) / tp), 0.0)
    buffers = np.where(pp > 1, 0.0, logits) + fsdp_buf + working
    last_stage = stored * ls + working + logits + fsdp_buf
    acts_peak = np.maximum(acts + buffers, last_stage)
    buffers = acts_peak - acts
    out.update({
        "mem_params_bytes": p_mp * param_b, "mem_grads_bytes": p_mp * grad_b,
        "mem_optimizer_bytes": p_mp * opt_b, "mem_activations_bytes": acts,
        "mem_buffers_bytes": buffers,
        "mem_fixed_bytes": co.mem_fixed_bytes + co.mem_frag * acts_peak,
    })
    out["peak_mem_bytes"] = sum(out[k] for k in MEM_TERMS)
    out["stage_micro_batch_s"] = per_mb
    out["inflight_layers"] = first_layers
    return out


LOSS_BYTES_PER_LOGIT = 12.0
TIME_TERMS = ("time_fwd_s", "time_bwd_s", "time_recompute_s", "time_tp_comm_s", "time_cp_comm_s",
              "time_pp_p2p_s", "time_pp_bubble_s", "time_dp_comm_exposed_s", "time_optimizer_s")
MEM_TERMS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes",
             "mem_activations_bytes", "mem_buffers_bytes", "mem_fixed_bytes")
