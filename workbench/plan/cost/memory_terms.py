"""Memory items of the cost model that depend only on the model, the stack and the degrees:
activation bytes per token and layer (Korthikanti et al. 2022), which layers the recompute policy
keeps, and the bytes of weights, gradients and optimizer state per parameter. workbench.plan.terms
multiplies them out per stage and schedule."""

from __future__ import annotations

import numpy as np

from workbench.plan.cost.columns import Recompute
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software

# Eager cross-entropy on fp32 logits (`logits.float()`, as torchtitan and this engine do): at the
# start of the backward three fp32 tensors of the logits' size are alive at once: the saved
# log-probabilities, the incoming gradient and the gradient log-softmax returns.
LOSS_BYTES_PER_LOGIT = 12.0
FP32_BYTES = 4.0
# The eager attention core of a `kernel: torch` stack (Aleph Alpha scaling's MaskedSoftmaxTorch:
# masked_fill_ in place, softmax, with softmax_in_fp32 a cast on either side), per attention
# score and by softmax dtype bytes: (HBM bytes its non-GEMM aten ops read and write over forward
# and backward, bytes autograd keeps for the backward), without the mask's 1 byte per (sequence,
# query, key) that masked_fill reads forward and backward. tests/test_eager_attention.py counts
# both from the ops autograd runs. 16-bit: masked_fill_ (4) and softmax (4) forward; backward
# softmax (6), the mask (4) and, because the in-place fill hit a view of the score GEMM's output,
# autograd's CopySlices around it (new_zeros 2, copy_ 4, copy_ 4, clone 4, copy_ 4): 36, keeping
# the softmax output. fp32: casts (6 + 6), masked_fill_ (8), softmax (8) forward; casts (6 + 6),
# softmax (12), the mask (8) backward: 60, keeping the fp32 softmax output and its 16-bit copy.
EAGER_SOFTMAX_SCORE_BYTES = {2.0: (36.0, 2.0), 4.0: (60.0, 6.0)}


def loss_bytes_per_token(vocab: int, sw: Software, tp: np.ndarray, ga: np.ndarray
                         ) -> np.ndarray:
    """Bytes per token the loss holds on the last stage at its backward: a vocab-parallel loss
    (Megatron, torchtitan) 1/tp of the vocabulary per rank, a gathered one all of it."""
    if sw.gathered_logits:
        return gathered_loss_bytes_per_logit(sw, ga) * vocab
    return LOSS_BYTES_PER_LOGIT * vocab / tp


def gathered_loss_bytes_per_logit(sw: Software, ga: np.ndarray) -> np.ndarray:
    """Bytes per logit of the full vocabulary alive on every TP rank at the loss backward of a
    stack that gathers the logits before an eager fp32 loss (Software.gathered_logits, the Aleph
    Alpha scaling code): the fp32 loss's 12, this micro-batch's gathered 16-bit logits, and the
    previous micro-batch's. Its pipeline engine keeps stage outputs in a ring of at least two
    buffers (pipeline_schedule/train.py `required_buffer_count`: max(2, ...)); on the last stage
    the output is the logits, which the loss reads with `get` and the backward never `take`s
    (parallel_module.py `_execute_loss_fn`, `_execute_backward_pass`), so one older copy is
    still allocated when this one's loss backward peaks (from the second of `ga` micro-batches
    on: the ring is emptied at each step's start). tests/test_loss_memory.py measures these
    ops' peak on CPU: 16 bytes per logit."""
    return LOSS_BYTES_PER_LOGIT + sw.act_bytes * np.where(ga > 1, 2.0, 1.0)


def activation_bytes_per_token(ms: ModelShape, sw: Software, tp: np.ndarray, sp: np.ndarray
                               ) -> dict[str, np.ndarray]:
    """Korthikanti et al. (2022) itemization per token and layer, generalized to GQA/SwiGLU:
    'rep' is replicated across TP ranks unless sequence parallel, 'split' is divided by TP,
    'quad' is the s*s attention part (softmax, its dropout) that selective recompute drops;
    'unfused' what unfused norms and SwiGLU keep on top, and what Transformer Engine's FP8
    linears keep less (memory only)."""
    e, h = sw.act_bytes, ms.hidden
    mask = 1.0 if sw.dropout else 0.0
    rep = e * h * 4 + 2 * h * mask  # 2 norm inputs, qkv input, mlp input; 2 dropout masks
    split = e * (2 * ms.q_width + 2 * ms.kv_width) + e * ms.ffn_hidden * (3 if ms.gated_mlp else 2)
    # Kept only because ops are not fused (memory, not extra HBM traffic: the elementwise time
    # already counts eager kernels by Coefficients.eager_elem_factor): an unfused RMSNorm keeps
    # what eager_norm_bytes_per_elem says, twice a layer, where `rep` counts a fused norm's
    # 16-bit input; an unfused SwiGLU keeps one more ffn-wide tensor (mlp_tensors);
    # Software.attention_copies three of the Q width.
    unfused_rep = 2 * h * (eager_norm_bytes_per_elem(e) - e) if sw.unfused_norm else 0.0
    unfused_split = e * ms.ffn_hidden * (mlp_tensors(ms, sw) - (3 if ms.gated_mlp else 2)) \
        + (e * 3 * ms.q_width if sw.attention_copies else 0.0)
    # TE's FP8 linears save the one-byte FP8 cast of their input for the weight gradient
    # (TE 1.8 linear.py `saved_inputmat`, layernorm_linear.py `ln_out` as uint8): the QKV, MLP
    # and down-projection inputs keep 1 byte, not e; the output projection keeps an FP8 copy
    # beside the attention output the fused core keeps.
    if sw.precision == "fp8" and sw.fp8_scaling == "te_delayed":
        unfused_rep -= 2 * h * (e - 1)
        unfused_split += ms.q_width - ms.ffn_hidden * (e - 1)
    if sw.flash_attention:
        quad = 4.0 * ms.n_heads  # logsumexp statistics only
    elif sw.eager_softmax_bytes:
        quad = ms.n_heads * ms.seq_len * (EAGER_SOFTMAX_SCORE_BYTES[sw.eager_softmax_bytes][1]
                                          + mask * (1 + e))
    else:
        quad = ms.n_heads * ms.seq_len * (e + mask * (1 + e))
    rep_div = np.where(sp > 0, tp, 1.0)
    return {"rep": rep / rep_div, "split": split / tp, "quad": quad / tp, "input": e * h / rep_div,
            "unfused": unfused_rep / rep_div + unfused_split / tp}


def quad_fwd_bytes(ms: ModelShape, sw: Software, tp: np.ndarray, generic: np.ndarray
                   ) -> np.ndarray:
    """HBM bytes per token and layer charged to the s*s part of the attention core's forward
    (the backward is charged twice that, as every elementwise term). An eager core
    (Software.eager_softmax_bytes) pays a third of the op-by-op total of EAGER_SOFTMAX_SCORE_BYTES
    over the rank's heads, plus the mask, one per sequence shared by the heads. Otherwise it
    pays `generic`, the elementwise traffic over the stored score tensors."""
    if not sw.eager_softmax_bytes or sw.flash_attention:
        return generic
    moved = EAGER_SOFTMAX_SCORE_BYTES[sw.eager_softmax_bytes][0]
    return ms.seq_len * (moved * ms.n_heads / tp + 2.0) / 3.0


def eager_norm_bytes_per_elem(e: float) -> float:
    """Bytes per hidden element one eager RMSNorm keeps for the backward, e the activations'
    bytes. The Aleph Alpha stack's torch path (nn/norm/rms_norm.py at commit 7848929, the public
    version that still has the paper's `flash_attn_rms_norm` kernel option beside it) computes
    `self._norm(x.float()).type_as(x) * weight`: `pow` and the multiply by 1/rms save the fp32
    copy of the input (4 bytes), the product with the weight saves the normalized tensor cast
    back (e); the 16-bit input itself is saved by nothing (`.float()` needs no input for its
    backward). The fused kernel (and Korthikanti's count) keeps the 16-bit input only (e).
    In fp32 training `.float()` is the input itself: e + e, input and normalized tensor."""
    return FP32_BYTES + e if e < FP32_BYTES else 2 * e


def mlp_tensors(ms: ModelShape, sw: Software) -> int:
    """Tensors of ffn width one layer keeps for the backward: GeLU keeps its input and output
    (the latter for the down projection); a fused SwiGLU keeps gate, up and their product;
    `silu(x) * gate` as eager ops keeps the silu output too (Software.unfused_swiglu)."""
    if not ms.gated_mlp:
        return 2
    return 4 if sw.unfused_swiglu else 3


def recompute_fractions(rc: np.ndarray, sw: Software
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share of layers fully checkpointed, 1 where only the attention core is recomputed,
    1 where the op policy checkpoints every layer: op_policy_items).

    full: every layer keeps only its input (Korthikanti "full"). selective: without fused
    attention, Korthikanti's selective recompute of the s*s attention core; with fused attention
    there is no s*s tensor to drop, so selective means checkpointing every other layer
    (torchtitan's selective layer policy, ac_freq=2)."""
    op, full = np.where(rc == Recompute.SELECTIVE_OP, 1.0, 0.0), rc == Recompute.FULL
    if sw.flash_attention:
        return np.where(full, 1.0, np.where(rc == Recompute.SELECTIVE, 0.5, 0.0)), \
            np.zeros_like(rc), op
    return np.where(full, 1.0, 0.0), np.where(rc == Recompute.SELECTIVE, 1.0, 0.0), op


def op_policy_items(ms: ModelShape, sw: Software, act: dict[str, np.ndarray], tp: np.ndarray,
                    sp: np.ndarray) -> tuple[float, np.ndarray]:
    """(share of a block's forward GEMM FLOPs that `selective_op` redoes, bytes per token and
    layer it keeps), for the op policy of train/parallel/recompute.py, which makes the trade of
    torchtitan's `selective_ac_option = "op"` (models/llama3/infra/parallelize.py `_save_list`,
    2024-12 to 2025-06): the 1st, 3rd, ... matmul (aten.mm) of the block's forward keeps its
    output and the others are redone with every elementwise op; the attention core and the
    reductions (reduce-scatter; this engine's all-reduce too) keep theirs, and an SP all-gather
    is redone (stage() charges it). For a Llama block that keeps q, v, w1 and w2 (a row-parallel
    output is the whole hidden width before its reduction) and redoes k, o and w3, about a
    third of the GEMM FLOPs. FP8 linears run aten._scaled_mm, which the list does not name, so
    every block GEMM is redone and none kept: the torchtitan_h200 rows' published peaks (47.96
    and 46.97 GiB, FP8, op policy, compiled) are what that predicts (45.6 / 43.7), not what
    saving them would (69.6 / 67.8). Kept besides: the block's input and the attention output
    and statistics of a fused attention core (an eager core's batched matmuls and softmax are
    not on the list: they are redone). A factorized block's factors count as matmuls in order."""
    e, h = sw.act_bytes, float(ms.hidden)
    share, split, whole = _op_policy_matmuls(ms, sw)
    reductions = np.where(tp > 1, np.where(sp > 0, 2 * h / tp, 2 * h), 0.0)
    core = act["quad"] + e * ms.q_width / tp if sw.flash_attention else 0.0
    return share, act["input"] + core + e * (split / tp + whole + reductions)


def _op_policy_matmuls(ms: ModelShape, sw: Software) -> tuple[float, float, float]:
    """(share of the GEMM FLOPs redone, output width kept of column-parallel matmuls, of
    row-parallel ones) under the op policy, dense and factorized blocks averaged by count."""
    if sw.precision == "fp8":
        return 1.0, 0.0, 0.0
    f_lr, share, split, whole = ms.lowrank_layers / ms.n_layers, 0.0, 0.0, 0.0
    for linears, weight in ((ms.dense, 1 - f_lr), (ms.lowrank, f_lr)):
        if not linears or not weight:
            continue
        flops = [m * n for m, n, _ in linears]
        share += weight * sum(flops[1::2]) / sum(flops)
        split += weight * sum(n for _, n, col in linears[::2] if col)
        whole += weight * sum(n for _, n, col in linears[::2] if not col)
    return share, split, whole


def op_policy_share(ms: ModelShape, sw: Software) -> float:
    """The share of a block's forward GEMM FLOPs the op policy redoes (op_policy_items)."""
    return _op_policy_matmuls(ms, sw)[0]


def state_bytes_per_param(sw: Software, dps: np.ndarray, dpr: np.ndarray, w_bytes: float
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, gradients, optimizer) bytes per parameter of one rank's model-parallel shard.

    FSDP (dps > 1) keeps fp32 weights, gradients and Adam m, v sharded (4 + 4 + 8 over dps).
    Unsharded: 16-bit working weights, a gradient buffer, and fp32 master + m + v (12; 8 in
    fp32, where the weights are the master). A distributed optimizer (Megatron-Core, NeMo's
    distributed fused Adam, ZeRO-1) shards only those 12 bytes over its data-parallel group
    (dp x cp in Megatron-Core): Megatron-LM docs/distrib_optimizer.md, 6 + 12/d bytes for
    bf16 weights with fp32 gradients, 4 + 12/d with 16-bit gradient buffers."""
    master = 8.0 if w_bytes >= 4 else 12.0
    grad_full = max(sw.grad_buffer_bytes, w_bytes)
    opt_full = np.where(sw.dist_optimizer, master / np.maximum(dpr, 1), master)
    return (np.where(dps > 1, 4.0 / dps, w_bytes), np.where(dps > 1, 4.0 / dps, grad_full),
            np.where(dps > 1, 8.0 / dps, opt_full))


def gather_bytes(ms: ModelShape, sw: Software, w_bytes: float) -> tuple[float, float]:
    """Bytes per parameter of an FSDP all-gather (and of the unsharded copy it fills): over
    the whole model, and over one block. The working weight's width, or under
    Software.fsdp_fp8_gather one byte for the block linears (norms, embedding and head stay
    at the working width)."""
    if not (sw.fsdp_fp8_gather and sw.precision == "fp8"):
        return w_bytes, w_bytes
    block, linear = ms.mean_layer_params(), ms.mean_layer_matmul_params()
    total = ms.n_layers * block + ms.embed_params + ms.head_params
    share = ms.n_layers * linear / total
    return share + (1.0 - share) * w_bytes, (linear + (block - linear) * w_bytes) / block
