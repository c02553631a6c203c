"""What one layer stores for its backward, per token: activation bytes (Korthikanti et al. 2022,
generalized to GQA, SwiGLU and the unfused ops of eager stacks), the loss's logits buffers, and
what each recompute policy keeps or redoes. These depend only on the model, the stack and the
degrees; workbench.plan.cost.memory multiplies them out per stage and schedule."""

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


def loss_bytes_per_token(vocab: int, software: Software, tp: np.ndarray, ga: np.ndarray
                         ) -> np.ndarray:
    """Bytes per token the loss holds on the last stage at its backward: a vocab-parallel loss
    (Megatron, torchtitan) 1/tp of the vocabulary per rank, a gathered one all of it."""
    if software.gathered_logits:
        return gathered_loss_bytes_per_logit(software, ga) * vocab
    return LOSS_BYTES_PER_LOGIT * vocab / tp


def gathered_loss_bytes_per_logit(software: Software, ga: np.ndarray) -> np.ndarray:
    """Bytes per logit of the full vocabulary alive on every TP rank at the loss backward of a
    stack that gathers the logits before an eager fp32 loss (Software.gathered_logits, the Aleph
    Alpha scaling code): the fp32 loss's 12, this micro-batch's gathered 16-bit logits, and the
    previous micro-batch's. Its pipeline engine keeps stage outputs in a ring of at least two
    buffers (pipeline_schedule/train.py `required_buffer_count`: max(2, ...)); on the last stage
    the output is the logits, which the loss reads with `get` and the backward never `take`s
    (parallel_module.py `_execute_loss_fn`, `_execute_backward_pass`), so one older copy is
    still allocated when this one's loss backward peaks (from the second of `ga` micro-batches
    on: the ring is emptied at each step's start). tests/test_loss_memory.py measures these
    ops' peak on CPU against this count."""
    return LOSS_BYTES_PER_LOGIT + software.act_bytes * np.where(ga > 1, 2.0, 1.0)


def activation_bytes_per_token(shape: ModelShape, software: Software, tp: np.ndarray,
                               sp: np.ndarray) -> dict[str, np.ndarray]:
    """Korthikanti et al. (2022) itemization per token and layer, generalized to GQA/SwiGLU:
    'rep' is replicated across TP ranks unless sequence parallel, 'split' is divided by TP,
    'quad' is the s*s attention part (softmax, its dropout) that selective recompute drops;
    'unfused' what unfused norms and SwiGLU keep on top, and what Transformer Engine's FP8
    linears keep less (memory only)."""
    elem_bytes, hidden = software.act_bytes, shape.hidden
    mask = 1.0 if software.dropout else 0.0
    # 2 norm inputs, qkv input, mlp input; 2 dropout masks
    rep = elem_bytes * hidden * 4 + 2 * hidden * mask
    mlp_kept = 3 if shape.gated_mlp else 2
    split = elem_bytes * (2 * shape.q_width + 2 * shape.kv_width) \
        + elem_bytes * shape.ffn_hidden * mlp_kept
    # Kept only because ops are not fused (memory, not extra HBM traffic: the elementwise time
    # already counts eager kernels by Coefficients.eager_elem_factor): an unfused RMSNorm keeps
    # what eager_norm_bytes_per_elem says, twice a layer, where `rep` counts a fused norm's
    # 16-bit input; an unfused SwiGLU keeps one more ffn-wide tensor (mlp_tensors);
    # Software.attention_copies three of the Q width.
    unfused_rep = 2 * hidden * (eager_norm_bytes_per_elem(elem_bytes) - elem_bytes) \
        if software.unfused_norm else 0.0
    unfused_split = elem_bytes * shape.ffn_hidden * (mlp_tensors(shape, software) - mlp_kept) \
        + (elem_bytes * 3 * shape.q_width if software.attention_copies else 0.0)
    # TE's FP8 linears save the one-byte FP8 cast of their input for the weight gradient
    # (TE 1.8 linear.py `saved_inputmat`, layernorm_linear.py `ln_out` as uint8): the QKV, MLP
    # and down-projection inputs keep 1 byte, not 2; the output projection keeps an FP8 copy
    # beside the attention output the fused core keeps.
    if software.precision == "fp8" and software.fp8_scaling == "te_delayed":
        unfused_rep -= 2 * hidden * (elem_bytes - 1)
        unfused_split += shape.q_width - shape.ffn_hidden * (elem_bytes - 1)
    if software.flash_attention:
        quad = 4.0 * shape.n_heads  # logsumexp statistics only
    elif software.eager_softmax_bytes:
        kept = EAGER_SOFTMAX_SCORE_BYTES[software.eager_softmax_bytes][1]
        quad = shape.n_heads * shape.seq_len * (kept + mask * (1 + elem_bytes))
    else:
        quad = shape.n_heads * shape.seq_len * (elem_bytes + mask * (1 + elem_bytes))
    rep_div = np.where(sp > 0, tp, 1.0)
    return {"rep": rep / rep_div, "split": split / tp, "quad": quad / tp,
            "input": elem_bytes * hidden / rep_div,
            "unfused": unfused_rep / rep_div + unfused_split / tp}


def quad_fwd_bytes(shape: ModelShape, software: Software, tp: np.ndarray, generic: np.ndarray
                   ) -> np.ndarray:
    """HBM bytes per token and layer charged to the s*s part of the attention core's forward
    (the backward is charged twice that, as every elementwise term). An eager core
    (Software.eager_softmax_bytes) pays a third of the op-by-op total of EAGER_SOFTMAX_SCORE_BYTES
    over the rank's heads, plus the mask, one per sequence shared by the heads. Otherwise it
    pays `generic`, the elementwise traffic over the stored score tensors."""
    if not software.eager_softmax_bytes or software.flash_attention:
        return generic
    moved = EAGER_SOFTMAX_SCORE_BYTES[software.eager_softmax_bytes][0]
    return shape.seq_len * (moved * shape.n_heads / tp + 2.0) / 3.0


def eager_norm_bytes_per_elem(elem_bytes: float) -> float:
    """Bytes per hidden element one eager RMSNorm keeps for the backward, `elem_bytes` (e) the
    activations' bytes. The Aleph Alpha stack's torch path (nn/norm/rms_norm.py at commit
    7848929, the public version that still has the paper's `flash_attn_rms_norm` kernel option
    beside it) computes `self._norm(x.float()).type_as(x) * weight`: `pow` and the multiply by
    1/rms save the fp32 copy of the input (4 bytes), the product with the weight saves the
    normalized tensor cast back (e); the 16-bit input itself is saved by nothing (`.float()`
    needs no input for its backward). The fused kernel (and Korthikanti's count) keeps the
    16-bit input only (e). In fp32 training `.float()` is the input itself: e + e, input and
    normalized tensor."""
    return FP32_BYTES + elem_bytes if elem_bytes < FP32_BYTES else 2 * elem_bytes


def mlp_tensors(shape: ModelShape, software: Software) -> int:
    """Tensors of ffn width one layer keeps for the backward: GeLU keeps its input and output
    (the latter for the down projection); a fused SwiGLU keeps gate, up and their product;
    `silu(x) * gate` as eager ops keeps the silu output too (Software.unfused_swiglu)."""
    if not shape.gated_mlp:
        return 2
    return 4 if software.unfused_swiglu else 3


def recompute_fractions(rc: np.ndarray, software: Software
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share of layers fully checkpointed, 1 where only the attention core is recomputed,
    1 where the op policy checkpoints every layer: op_policy_items).

    full: every layer keeps only its input (Korthikanti "full"). selective: without fused
    attention, Korthikanti's selective recompute of the s*s attention core; with fused attention
    there is no s*s tensor to drop, so selective means checkpointing every other layer
    (torchtitan's selective layer policy, ac_freq=2)."""
    op, full = np.where(rc == Recompute.SELECTIVE_OP, 1.0, 0.0), rc == Recompute.FULL
    if software.flash_attention:
        return np.where(full, 1.0, np.where(rc == Recompute.SELECTIVE, 0.5, 0.0)), \
            np.zeros_like(rc), op
    return np.where(full, 1.0, 0.0), np.where(rc == Recompute.SELECTIVE, 1.0, 0.0), op


def op_policy_items(shape: ModelShape, software: Software, act: dict[str, np.ndarray],
                    tp: np.ndarray, sp: np.ndarray) -> tuple[float, np.ndarray]:
    """(share of a block's forward GEMM FLOPs that `selective_op` redoes, bytes per token and
    layer it keeps), for the op policy of train/parallel/recompute.py, which makes the trade of
    torchtitan's `selective_ac_option = "op"` (models/llama3/infra/parallelize.py `_save_list`,
    2024-12 to 2025-06): the 1st, 3rd, ... matmul (aten.mm) of the block's forward keeps its
    output and the others are redone with every elementwise op; the attention core and the
    reductions (reduce-scatter; this engine's all-reduce too) keep theirs, and an SP all-gather
    is redone (stage() charges it). For a Llama block that keeps q, v, w1 and w2 (a row-parallel
    output is the whole hidden width before its reduction) and redoes k, o and w3, about a
    third of the GEMM FLOPs. FP8 linears run aten._scaled_mm, which the list does not name, so
    every block GEMM is redone and none kept (the torchtitan_h200 rows' published peaks agree:
    README, the op policy). Kept besides: the block's input and the attention output
    and statistics of a fused attention core (an eager core's batched matmuls and softmax are
    not on the list: they are redone). A factorized block's factors count as matmuls in order."""
    elem_bytes, hidden = software.act_bytes, float(shape.hidden)
    share, split, whole = _op_policy_matmuls(shape, software)
    reductions = np.where(tp > 1, np.where(sp > 0, 2 * hidden / tp, 2 * hidden), 0.0)
    core = act["quad"] + elem_bytes * shape.q_width / tp if software.flash_attention else 0.0
    return share, act["input"] + core + elem_bytes * (split / tp + whole + reductions)


def _op_policy_matmuls(shape: ModelShape, software: Software) -> tuple[float, float, float]:
    """(share of the GEMM FLOPs redone, output width kept of column-parallel matmuls, of
    row-parallel ones) under the op policy, dense and factorized blocks averaged by count."""
    if software.precision == "fp8":
        return 1.0, 0.0, 0.0
    lowrank_share, share, split, whole = shape.lowrank_layers / shape.n_layers, 0.0, 0.0, 0.0
    for linears, weight in ((shape.dense, 1 - lowrank_share), (shape.lowrank, lowrank_share)):
        if not linears or not weight:
            continue
        flops = [m * n for m, n, _ in linears]
        share += weight * sum(flops[1::2]) / sum(flops)
        split += weight * sum(n for _, n, col in linears[::2] if col)
        whole += weight * sum(n for _, n, col in linears[::2] if not col)
    return share, split, whole


def op_policy_share(shape: ModelShape, software: Software) -> float:
    """The share of a block's forward GEMM FLOPs the op policy redoes (op_policy_items)."""
    return _op_policy_matmuls(shape, software)[0]
