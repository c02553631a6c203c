"""The model's size as arithmetic on its config: parameters and training FLOPs per token.

Apart from the model file so that what only needs the numbers (the driver recording a run's
n_params, the planner pricing a 405B model) neither allocates anything nor imports torch.
"""

from __future__ import annotations

from workbench.config import ModelConfig


def head_dim(cfg: ModelConfig) -> int:
    return cfg.hidden // cfg.n_heads


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block."""
    hd = head_dim(cfg)
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    attn = cfg.hidden * q + 2 * cfg.hidden * kv + q * cfg.hidden
    if cfg.family == "llama":
        mlp, norms = 3 * cfg.hidden * cfg.ffn_hidden, 2 * cfg.hidden
    else:
        mlp, norms = 2 * cfg.hidden * cfg.ffn_hidden, 2 * cfg.hidden * (2 if cfg.bias else 1)
    if cfg.bias:
        attn += q + 2 * kv + cfg.hidden
        mlp += cfg.ffn_hidden * (2 if cfg.family == "llama" else 1) + cfg.hidden
    return attn + mlp + norms


def n_params(cfg: ModelConfig) -> int:
    """Total parameters, as the published counts give them (tied embeddings counted once)."""
    emb = cfg.vocab * cfg.hidden
    pos = cfg.seq_len * cfg.hidden if cfg.family == "gpt2" else 0
    head = 0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden
    final_norm = cfg.hidden * (2 if cfg.family == "gpt2" and cfg.bias else 1)
    return emb + pos + head + final_norm + cfg.n_layers * layer_params(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token (blocks' linears + LM head)."""
    hd = head_dim(cfg)
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    attn = cfg.hidden * q + 2 * cfg.hidden * kv + q * cfg.hidden
    mlp = (3 if cfg.family == "llama" else 2) * cfg.hidden * cfg.ffn_hidden
    return cfg.n_layers * (attn + mlp) + cfg.vocab * cfg.hidden


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): 6 per matmul parameter
    plus the attention score and value products (12 * layers * seq * q-width), as in PaLM's MFU."""
    s = seq_len or cfg.seq_len
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * s * cfg.n_heads * head_dim(cfg)
