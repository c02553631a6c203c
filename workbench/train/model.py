"""One decoder-only transformer for the Llama family (RMSNorm, RoPE, SwiGLU, grouped-query
attention) and the GPT-2 family (LayerNorm, learned positions, GELU).

The model knows nothing about parallelism. Its submodules are named so that the engine can
shard them by name (tensor parallel plans) and drop them (pipeline stages: a missing embedding,
layer or head is None / absent from `layers`, and forward skips it).
`n_params(cfg)` and `flops_per_token(cfg)` are arithmetic on the config (workbench.train.counts,
re-exported here), so the planner can use them for a 405B model without allocating anything.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.train.counts import (  # noqa: F401  (re-exported: the model's sizes)
    flops_per_token,
    head_dim,
    layer_params,
    matmul_params,
    n_params,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.family == "llama":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin of rotary angles, shape (seq_len, head_dim // 2, 2)."""
    hd = head_dim(cfg)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    ang = torch.outer(torch.arange(cfg.seq_len, device=device).float(), inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x (B, T, H, D) by the angles in table (T, D/2, 2)."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    out = torch.stack([xf[..., 0] * cos - xf[..., 1] * sin,
                       xf[..., 0] * sin + xf[..., 1] * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention over (B, heads, T, head_dim); a module of its own so
    that context parallelism can swap it (train/parallel/context.py) without this file knowing."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = head_dim(cfg)
        self.head_dim, self.rope = hd, cfg.family == "llama"
        self.wq = nn.Linear(cfg.hidden, cfg.n_heads * hd, bias=cfg.bias)
        self.wk = nn.Linear(cfg.hidden, cfg.n_kv_heads * hd, bias=cfg.bias)
        self.wv = nn.Linear(cfg.hidden, cfg.n_kv_heads * hd, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.hidden, bias=cfg.bias)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.family == "llama"
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        if self.gated:
            self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm, self.attention = _norm(cfg), Attention(cfg)
        self.ffn_norm, self.feed_forward = _norm(cfg), FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.family == "gpt2" \
            else None
        # A ModuleDict keyed by the global layer index keeps names stable when a pipeline
        # stage keeps only some layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = _norm(cfg)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Position of each token of a sequence: the RoPE angles (llama) or the learned-position
        # ids (gpt2). Buffers, so that context parallelism can hand a rank its own positions.
        self.register_buffer("rope", rope_tables(cfg) if cfg.family == "llama" else None,
                             persistent=False)
        self.register_buffer("positions", torch.arange(cfg.seq_len)
                             if cfg.family == "gpt2" else None, persistent=False)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std, generator=generator)
        if self.rope is not None:
            self.rope = rope_tables(self.cfg, self.rope.device)
        if self.positions is not None:
            self.positions = torch.arange(self.cfg.seq_len, device=self.positions.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); a pipeline stage without the embedding takes
        hidden states instead, and one without the head returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(self.positions[: h.shape[1]])
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


META_ABOVE_PARAMS = 200_000_000


def build(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """The model with its seeded initial weights, drawn on the CPU so that every layout and
    device starts from the same weights. A large model is laid out on the meta device first
    (PyTorch's default init of billions of weights would be thrown away); a small one is built
    on the CPU directly, since the meta device's first use pays for lazy imports of its own."""
    if n_params(cfg) > META_ABOVE_PARAMS:
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cpu")
        if cfg.tie_embeddings:  # to_empty allocates each module's tensors anew: tie again
            model.output.weight = model.tok_embeddings.weight
    else:
        model = Transformer(cfg)
    with torch.no_grad():
        model.init_weights(torch.Generator(device="cpu").manual_seed(seed))
    return model.to(device)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def trainable_params(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor once; a DTensor counts its global size. Every
    run logs it (`params/trainable`): low-rank training changes it mid-run, and the gradient
    bytes data parallelism moves per step follow it."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
