"""Tokens/s and MFU of a ~1B-parameter Llama-style model trained in bf16 on ONE GPU.

    python benchmarks/gpu_mfu.py [--steps 30] [--micro-batch 4] [--seq 2048] [--no-compile]

The model is workbench's own Transformer (Llama 3.2 1B shape: 16 layers, hidden 2048, 32 heads,
8 kv heads, ffn 8192, vocab 128256, tied embeddings: 1.24B parameters), trained with bf16
autocast over fp32 master weights, fused AdamW, flash attention through
scaled_dot_product_attention (the math kernel is excluded, so a fallback fails loudly), and
torch.compile per block. Tokens are random (throughput does not depend on them).
MFU = model FLOPs per token (6 N + attention, no recompute counted) x tokens/s / peak bf16 dense
FLOP/s of the GPU (H100/H200 SXM: 989 TFLOP/s; --peak-tflops overrides). Target: >= 45% on an
H100/H200-class GPU. Without CUDA it prints why and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
                    "GH200": 989.0, "B200": 2250.0}


def llama_1b(seq_len: int):
    from workbench.config import ModelConfig

    return ModelConfig(name="llama3_1b", family="llama", n_layers=16, hidden=2048, n_heads=32,
                       n_kv_heads=8, ffn_hidden=8192, vocab=128256, seq_len=seq_len,
                       tie_embeddings=True, rope_theta=500000.0)


def peak_tflops(name: str, override: float) -> float:
    if override > 0:
        return override
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name.upper():
            return value
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (dense bf16 TFLOP/s)")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=10, help="excluded from the average")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device here; this benchmark needs one GPU (H100/H200 class for "
              "the 45% MFU target). Nothing was run.", file=sys.stderr)
        return 1
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from workbench.train.model import build, cross_entropy, flops_per_token, n_params
    from workbench.train.optimizer import make_optimizer

    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    cfg = llama_1b(args.seq)
    model = build(cfg, seed=0, device=device)
    if not args.no_compile:
        for block in model.layers.values():
            block.compile()
    opt_cfg = _train_config()
    optimizer = make_optimizer(list(model.parameters()), opt_cfg, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens_per_step = args.micro_batch * args.seq
    times: List[float] = []
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab, (args.micro_batch, args.seq), device=device,
                          generator=gen)
        y = torch.randint(0, cfg.vocab, (args.micro_batch, args.seq), device=device,
                          generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16), \
                sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                             SDPBackend.EFFICIENT_ATTENTION]):
            loss = cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step:3d}  loss {loss.item():.3f}  {times[-1] * 1e3:8.1f} ms  "
              f"{tokens_per_step / times[-1]:10.0f} tok/s", file=sys.stderr)
    measured = times[args.warmup_steps:] or times
    step_s = sum(measured) / len(measured)
    tok_s = tokens_per_step / step_s
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, args.peak_tflops) * 1e12
    mfu = flops_per_token(cfg, args.seq) * tok_s / peak
    print(f"{name}: {n_params(cfg) / 1e9:.2f}B params, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, bf16, compile={not args.no_compile}")
    print(f"step_time_s {step_s:.4f}  tokens_per_s {tok_s:.0f}  mfu {mfu:.1%}  "
          f"peak_mem_bytes {torch.cuda.max_memory_allocated(device)}")
    return 0


def _train_config():
    from workbench.config import RunConfig

    cfg = RunConfig()
    cfg.train.lr, cfg.train.weight_decay = 3e-4, 0.1
    return cfg


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
