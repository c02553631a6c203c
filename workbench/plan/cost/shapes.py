"""The model as the cost model sees it: the matrix shapes of one block, embeddings, and how a
low-rank factorization changes them.

Kept apart from workbench.train.model so the planner never imports torch; a test checks that the
counts here equal train.model.matmul_params / flops_per_token for full-rank models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.config import LowRankConfig, ModelConfig
from workbench.lowrank.ranks import fixed_rank, no_gain

# (rows m, cols n, column_parallel) of each linear in a block; column-parallel linears are split
# along n by tensor parallelism, row-parallel ones along m (Megatron's pairing).
Linear = tuple[int, int, bool]


@dataclass(frozen=True)
class ModelShape:
    """Dimensions and per-block matrices, with low-rank factorization already applied."""

    n_layers: int
    hidden: int
    q_width: int  # n_heads * head_dim
    kv_width: int  # n_kv_heads * head_dim
    ffn_hidden: int
    vocab: int
    seq_len: int
    n_heads: int
    head_dim: int
    gated_mlp: bool  # SwiGLU (3 matrices, 3 stored ffn-wide tensors) vs GELU (2 and 2)
    dense: tuple[Linear, ...]  # linears of a full-rank block
    lowrank: tuple[Linear, ...]  # linears of a factorized block (empty: none)
    lowrank_layers: int  # how many blocks are factorized
    other_layer_params: int  # norms and biases of one block
    embed_params: int  # token (+ learned position) embedding
    head_params: int  # LM head (0 when tied to the embedding)
    dp_bytes_ratio: float  # gradient bytes DP exchanges, relative to dense (PowerSGD < 1)
    bias: bool = False  # linears and norms carry biases

    def layer_matmul_params(self, lowrank: bool = False) -> int:
        return sum(m * n for m, n, _ in (self.lowrank if lowrank else self.dense))

    def mean_layer_matmul_params(self) -> float:
        f = self.lowrank_layers / self.n_layers
        return (1 - f) * self.layer_matmul_params() + f * self.layer_matmul_params(True)

    def mean_layer_params(self) -> float:
        return self.mean_layer_matmul_params() + self.other_layer_params

    def model_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token without recomputation (PaLM / Megatron MFU count:
        6 per matmul parameter incl. the LM head, plus 12 * layers * seq * q_width)."""
        mm = self.n_layers * self.mean_layer_matmul_params() + self.vocab * self.hidden
        return 6.0 * mm + 12.0 * self.n_layers * self.seq_len * self.q_width


def _factor(m: int, n: int, col: bool, ratio: float, multiple: int = 1) -> tuple[Linear, ...]:
    """(m, n) -> (m, r) then (r, n): FLOPs and parameters scale by r(m+n)/(mn). The rank is the
    one training picks (workbench.lowrank.ranks.fixed_rank), and a layer whose factors would not
    be smaller stays dense, as training's no-gain guard keeps it."""
    r = fixed_rank(ratio, n, m, multiple)
    if no_gain(r, n, m):
        return ((m, n, col),)
    return ((m, r, col), (r, n, col))


def lowrank_flops_ratio(m: int, n: int, rank: int) -> float:
    """FLOPs (and parameters) of a rank-r factorized (m, n) linear relative to the dense one."""
    return rank * (m + n) / (m * n)


def model_shape(model: ModelConfig, lowrank: LowRankConfig | None = None,
                seq_len: int | None = None) -> ModelShape:
    """The shape of `model`, factorized as `lowrank` asks (modes fixed/adaptive use rank_ratio;
    powersgd keeps the model dense but compresses data-parallel gradients)."""
    h, hd = model.hidden, model.hidden // model.n_heads
    q, kv, f = model.n_heads * hd, model.n_kv_heads * hd, model.ffn_hidden
    gated = model.family == "llama"
    attn: tuple[Linear, ...] = ((h, q, True), (h, kv, True), (h, kv, True), (q, h, False))
    mlp: tuple[Linear, ...] = ((h, f, True), (h, f, True), (f, h, False)) if gated else \
        ((h, f, True), (f, h, False))
    dense = attn + mlp
    norms = 2 * h * (2 if (not gated and model.bias) else 1)
    bias = (q + 2 * kv + h + f * (2 if gated else 1) + h) if model.bias else 0
    s = int(seq_len or model.seq_len)
    embed = model.vocab * h + (s * h if model.family == "gpt2" else 0)
    head = 0 if model.tie_embeddings else model.vocab * h
    mode = lowrank.mode if lowrank is not None else "off"
    lr: tuple[Linear, ...] = ()
    n_lr, dp_ratio = 0, 1.0
    if mode in ("fixed", "adaptive"):
        lr = tuple(p for m, n, c in dense
                   for p in _factor(m, n, c, lowrank.rank_ratio, lowrank.round_to))
        n_lr = max(0, model.n_layers - lowrank.keep_first_blocks - lowrank.keep_last_blocks)
    elif mode == "powersgd":
        r = lowrank.powersgd_rank
        dense_n = sum(m * n for m, n, _ in dense)
        dp_ratio = sum(min(m * n, r * (m + n)) for m, n, _ in dense) / dense_n
    return ModelShape(model.n_layers, h, q, kv, f, model.vocab, s, model.n_heads, hd, gated,
                      dense, lr, n_lr, norms + bias, embed, head, dp_ratio, model.bias)


def fp8_operand_elems(ms: ModelShape, tp: np.ndarray) -> np.ndarray:
    """Elements per token of every FP8 linear's input and output(-gradient) on one TP rank:
    what rowwise scaling reads, reduces and casts once per pass (column-parallel linears see
    the gathered input, row-parallel ones the full output before its reduce-scatter)."""
    total = 0.0
    for m, n, col in ms.dense:
        total = total + (m + n / tp if col else m / tp + n)
    return total


def block_key(shape: ModelShape) -> str:
    """What one block's time depends on, so that a profile of one model prices any model with
    the same block (its name and depth do not matter)."""
    kv_heads = shape.kv_width // shape.head_dim
    return (f"{'gated' if shape.gated_mlp else 'gelu'} h{shape.hidden} heads{shape.n_heads} "
            f"kv{kv_heads} ffn{shape.ffn_hidden} seq{shape.seq_len} bias{int(shape.bias)}")
