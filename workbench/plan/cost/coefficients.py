"""The cost model's named coefficients: few, physical, each with where its default comes from.

Calibration (workbench.plan.calibrate) changes these numbers, never the formulas. A cluster's
YAML may override any of them in its `coeff:` mapping; an unknown name is a ConfigError so that a
typo cannot silently fall back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from workbench.config import ClusterConfig
from workbench.errors import ConfigError
from workbench.plan.cost.hardware import match_gpu


@dataclass(frozen=True)
class Coefficients:
    """Physically meaningful knobs of the cost model (fractions are 0-1, times in seconds)."""

    # Achieved fraction of dense tensor-core peak on a large GEMM. A100: cuBLAS FP16/BF16 GEMMs of
    # Megatron shapes reach ~250-270 of 312 TFLOP/s (NVIDIA "Deep Learning Performance" guide,
    # SC21 paper Fig. 14 microbenchmarks). H100 SXM: ~700-750 of 989 (NVIDIA H100 tuning guide).
    mm_eff_max: float = 0.82
    # GEMM dimension (rows or columns per rank) at which that fraction halves: tensor-core tiles
    # are 128-256 wide, so a dimension of a few tens wastes most of a tile (wave quantization).
    mm_dim_half: float = 40.0
    # 1: count the tile and wave quantization of the GEMM library exactly (workbench.plan.cost.
    # gemm_fill: 256x128 output tiles in waves of one per SM, on GPUs with a known SM count)
    # instead of the smooth mm_dim_half curve; 0: the smooth curve. On for Ampere, whose cuBLAS
    # launches one thread block per tile. Off for Hopper: its cuBLAS runs persistent,
    # warp-specialized kernels whose tile schedulers reorder and split the last wave's work (the
    # CUTLASS 3 Hopper kernels), and counting Ampere-style waves at 132 SMs makes the dgxc H100
    # rows, already predicted 4-11% too slow, 2 points worse. A byte/tile count, set by no row.
    gemm_tile_waves: float = 1.0
    # Fraction of peak a fused (flash) attention kernel reaches on the FLOPs it executes
    # (FlashAttention-2 paper: ~190/312 on A100 fwd+bwd; ~350-450/989 on H100 in torch SDPA).
    flash_eff: float = 0.6
    # FlashAttention 1.x throughput relative to FlashAttention-2 on the same GPU: FA2 splits work
    # over the sequence as well as batch x heads and cuts non-matmul FLOPs, "around 2x speedup
    # compared to FlashAttention" on A100 (Dao 2023, arXiv 2307.08691, abstract and Fig. 4-5).
    flash1_rel_speed: float = 0.5
    # Achieved fraction of HBM bandwidth in memory-bound kernels (STREAM-like copies reach 80-90%).
    hbm_eff: float = 0.8
    # HBM bytes moved by non-GEMM kernels (norms, activations, dropout, softmax, residual adds)
    # per byte of activation a layer stores: each tensor is written once and read about once.
    elem_traffic: float = 2.0
    # Fixed time per layer and micro-batch per forward pass: ~10 kernel launches at 3-5 us each
    # (CUDA launch latency) plus small-op tails that do not scale with size.
    kernel_overhead_s: float = 40e-6
    # Achieved FP8 over BF16 GEMM speedup including scaling and casts (peak is 2x; torchao
    # float8 reports ~1.4-1.6x on large linears).
    fp8_mm_speedup: float = 1.4
    # The same for Transformer Engine's delayed-scaling FP8 (Megatron-Core / NeMo): the amax
    # comes from the history, so casts are fused into the producing kernels (LayerNorm-Linear,
    # the activation before FC2), weights are cast once per step, and cuBLASLt FP8 GEMMs of
    # these shapes run near 2x BF16. Set by the dgxc_nemo2409 FP8 rows (benchmarks/calibration):
    # 405B (TP8 PP9 CP2 VP7) BF16/FP8 step times 17.20/11.24 s on 576 H100 with the GEMMs ~85%
    # of the step require ~1.8 on the GEMMs themselves.
    fp8_te_mm_speedup: float = 1.8
    # NCCL bus bandwidth as a fraction of link bandwidth (nccl-tests on DGX A100/H100: ~230/300
    # GB/s NVLink; 21-23/25 GB/s per HDR NIC, 45/50 per NDR NIC).
    link_eff_intra: float = 0.77
    link_eff_inter: float = 0.85
    # Per-collective latency per log2 step of a tree/ring (nccl-tests small-message times:
    # ~5-10 us inside NVLink, ~15-30 us across InfiniBand).
    coll_latency_intra_s: float = 8e-6
    coll_latency_inter_s: float = 20e-6
    # One pipeline send/recv of a small message (NCCL p2p over IB).
    p2p_latency_s: float = 20e-6
    # Fraction of tensor-parallel communication hidden behind GEMMs by Megatron-Core's
    # --tp-comm-overlap (Transformer Engine userbuffers: bulk overlap of the SP all-gather and
    # reduce-scatter with independent GEMMs plus pipelined ring-exchange; the TE comm-overlap
    # docs report most, not all, of it hidden). Vanilla TP hides none.
    tp_overlap: float = 0.7
    # The same for torchtitan's async TP (SymmetricMemory micro-pipelining). Async TP splits each
    # all-gather/reduce-scatter + matmul into tp per-peer chunks: the first chunk's transfer and
    # the reduce-scatter tail stay exposed and the smaller matmuls lose some efficiency. The
    # torchtitan async-TP benchmark (2025-06, Llama3 8B/70B, TP8) saves 0.25 s of a modelled
    # 0.64 s (8B) and 2.3 s of 5.0 s (70B) of BF16 TP communication per step: ~0.4-0.46.
    async_tp_overlap: float = 0.45
    # FP8 rowwise scaling (torchao): HBM bytes per element of every FP8 linear operand per pass
    # for its per-row amax and cast, not fused into the producer. Scaling along the contiguous
    # axis is one Inductor kernel (row reduction + cast: read 2, write 1 = 3); the transposed
    # operands the backward needs are scaled along the strided axis, a separate amax pass
    # (read 2) before the cast (read 2, write 1) = 5; about half of each: ~4. Tensorwise
    # scaling fuses both into the producing kernel under torch.compile (its cost is inside
    # fp8_mm_speedup). Check: the torchtitan async-TP benchmark puts rowwise 0.9 s (8B) and
    # 7.1 s (70B) per step behind tensorwise on its 2.4 TB/s HBM2e H100s, i.e. 3.6-3.8 bytes
    # per operand element and pass (vanilla TP) after the BF16-vs-FP8 TP gather difference.
    fp8_rowwise_cast_bytes: float = 4.0
    # Elementwise HBM traffic with torch.compile relative to the hand-fused kernels (Megatron /
    # Transformer Engine) elem_traffic stands for: fusion keeps intermediate tensors of
    # norm/activation/rope chains in registers.
    compile_elem_factor: float = 0.5
    # The same for PyTorch eager (torchtitan without torch.compile; Aleph Alpha scaling without
    # its RMS kernel): one kernel per op. Split in two, because the two groups scale differently
    # with TP: the replicated tensors (2 norm inputs, 2 residual adds: `rep`, not divided by TP
    # without SP) and the TP-split ones (SiLU, gate multiply, RoPE: `split`). Bytes per token of
    # a Llama-3 8B block, forward: fused kernels move ~16h on `rep` (RMSNorm read 2 + write 2,
    # residual add 6, per element) and ~52h on `split` (68h together, what elem_traffic stands
    # for). Eager, the Llama reference RMSNorm (float, pow, mean, mul, type_as, *w) moves ~36
    # bytes per element, so `rep` is 2 x 36h + 2 x 6h = 84h: 5.25x; the rest of the ~149h eager
    # total (65h) on `split`: 1.25x. (Aleph Alpha's RMSNorm skips the first upcast but adds a
    # float/type_as round trip after the normalization: ~26 bytes per element, 64h, 4.0x.)
    # Until 2026-12 one factor (2.2) covered both, which left the eager norms' cost too small at
    # high TP, where the split part shrinks and the replicated part does not.
    eager_elem_factor: float = 1.25
    eager_rep_factor: float = 5.25
    # Fraction of data-parallel communication hidden behind compute when the stack overlaps it
    # (bucketed all-reduce / FSDP prefetch; PyTorch DDP paper reports most of it hidden).
    dp_overlap: float = 0.85
    # Fraction of one ring step's K/V exchange hidden behind that step's attention at best
    # (copy engines and NCCL kernels still contend for HBM and SMs); the rest of the exchange is
    # exposed only when it outlasts the step's attention.
    cp_overlap: float = 0.5
    # KV-chunk length (tokens) at which a fused attention kernel's throughput halves relative
    # to long sequences: FlashAttention-2 (Dao 2023, Fig. 4-5, head dim 128) fwd+bwd reaches
    # ~0.75-0.8 of its long-sequence throughput at 512 tokens and ~0.9 at 2k -> ~200 tokens.
    # Ring attention runs one kernel per ring step on a chunk of s/cp (s/2cp balanced) keys.
    ring_chunk_half: float = 200.0
    # HBM bytes per output element and ring step to merge partial attention outputs: the
    # running output is kept in FP32 and rescaled by the new log-sum-exp (read 4 + read 2 of
    # the new block + write 4, ~10; PyTorch _templated_ring_attention / Megatron-Core CP).
    ring_merge_bytes: float = 10.0
    # DeepSpeed ZeRO-3 as of 2021 (Narayanan et al. SC21 Table 2): parameters are gathered per
    # parameter/small bucket with flat all-gathers, so cross-node traffic does not aggregate a
    # node's NICs the way one bucketed NCCL ring does. Achieved fraction of one NIC's NCCL
    # bandwidth: SC21 Table 2 step times are ~constant in micro-batch and scale with parameter
    # count, 6 bytes/param (2 gathers + fp16 reduce-scatter) in 65 s (175B) and 181 s (530B):
    # 16-18 GB/s per GPU over 200 Gb/s HDR (21 GB/s after link_eff_inter) -> ~0.8.
    zero3_gather_eff: float = 0.8
    # Fraction of those gathers hidden behind compute at best (DeepSpeed-2021 prefetch): the
    # same table's micro-batch-4 rows are ~30 s (175B) / ~100 s (530B) slower than their compute
    # although the gathers take less than the compute: about half stays exposed.
    zero3_overlap: float = 0.5
    # Memory no tensor accounts for: CUDA context, NCCL buffers, cuBLAS workspace (~1-2 GiB).
    mem_fixed_bytes: float = 1.5 * 2**30
    # Caching-allocator fragmentation, as a fraction of dynamic (activation + buffer) memory:
    # the one allowance `pred_fits` adds to the itemized peak (it compares peak + this + the
    # fixed bytes with HBM; --explain prints it; --margin-gib adds a stated margin on top).
    # Checked against torchtitan_2412's published max-reserved memory (16 rows, median 4%; FSDP2
    # without irregular recompute allocations); GMLake (Guo et al., ASPLOS 2024) measures 15% on
    # average, up to 33%, for eight LLMs on A100-80GB with recompute/offload/LoRA under
    # DeepSpeed/FSDP, so stacks with such allocation patterns may need more.
    mem_frag: float = 0.08


NAMES = tuple(f.name for f in fields(Coefficients))

# Defaults by accelerator (datasheet-class facts, see the comments on each field above).
_BY_GPU: dict[str, dict[str, float]] = {
    # A100: the low end (250 of 312 TFLOP/s) of the cuBLAS range above. Sustained training
    # runs hold clocks below the 1.41 GHz boost at 400 W, as on the H100 below, and every A100
    # row of three independent stacks (Megatron SC21 Tables 1-2, Korthikanti Table 5,
    # torchtitan FSDP2) is over-predicted at 0.82 (one number for the GPU, not per row).
    "A100": {"mm_eff_max": 0.80},
    # flash_eff: torch SDPA runs FlashAttention-2, which is not Hopper-tuned: the FA3 paper
    # (Shah et al. 2024, Fig. 5-6) measures FA2 fwd+bwd on H100 SXM5 at ~300-350 TFLOP/s for
    # head dim 128, i.e. ~0.33 of 989 (the 500 W part: x0.85, see below).
    # H100 SXM: sustained ~650 of 989 TFLOP/s on large BF16 GEMMs under training load (clocks
    # settle well under the 1.98 GHz boost; public GEMM benchmarks give 600-720).
    "H100": {"mm_eff_max": 0.66, "flash_eff": 0.33, "link_eff_intra": 0.8,
             "gemm_tile_waves": 0.0},
    "H100-PCIE": {"mm_eff_max": 0.62, "flash_eff": 0.42, "link_eff_intra": 0.8,
                  "gemm_tile_waves": 0.0},
    # 500 W cap (torchtitan Grand Teton): clocks scale ~ sqrt(power) near the top of the DVFS
    # curve, (500/700)^0.5 = 0.85 of the 700 W part.
    "H100-CAPPED": {"mm_eff_max": 0.56, "flash_eff": 0.28, "link_eff_intra": 0.8,
                    "gemm_tile_waves": 0.0},
    # H200: the H100 die with faster HBM; same compute clocks.
    "H200": {"mm_eff_max": 0.66, "flash_eff": 0.33, "link_eff_intra": 0.8,
             "gemm_tile_waves": 0.0},
}


def defaults_for(gpu: str) -> Coefficients:
    """The physical defaults for a GPU name (A100 figures where the name is unknown)."""
    try:
        spec = match_gpu(gpu)
    except KeyError:
        return Coefficients()
    name = spec.name.upper()
    if spec.power_capped:
        key = "H100-CAPPED"
    elif "PCIE" in name:
        key = "H100-PCIE"
    else:
        key = next((k for k in ("H200", "H100", "A100") if k in name), "A100")
    return replace(Coefficients(), **_BY_GPU[key])


def coefficients(cluster: ClusterConfig, overrides: Mapping[str, float] | None = None
                 ) -> Coefficients:
    """Defaults for the cluster's GPU, then its calibrated `coeff:` mapping, then overrides; a
    cluster that states its FP8 peak scales the FP8 GEMM speedups by its FP8/BF16 ratio."""
    merged: dict[str, float] = {}
    for source in (cluster.coeff or {}, overrides or {}):
        for name, value in dict(source).items():
            if name not in NAMES:
                raise ConfigError(f"cluster.coeff.{name}", value,
                                  f"unknown coefficient; valid: {', '.join(NAMES)}")
            merged[name] = float(value)
    if cluster.profile is not None and cluster.profile.memory.baseline_bytes > 0:
        # measured: what a process holds before any model (workbench/profile)
        merged.setdefault("mem_fixed_bytes", float(cluster.profile.memory.baseline_bytes))
    base = defaults_for(cluster.gpu)
    fp8 = float(getattr(cluster, "peak_fp8_flops", 0.0) or 0.0)
    if fp8 > 0:  # a stated FP8 peak: the FP8 speedups above are of H100's 2x-BF16 one
        ratio = fp8 / float(cluster.peak_bf16_flops) / 2.0
        for name in ("fp8_mm_speedup", "fp8_te_mm_speedup"):
            merged.setdefault(name, getattr(base, name) * ratio)
    return replace(base, **merged)
