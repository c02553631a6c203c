"""Where the cost model's hardware comes from: `hardware_for(cluster)`, the one function every
planner path asks for a cluster's GpuSpec, and the datasheets behind it.

The cluster's own figures win (its YAML; measured hardware would come in here too); the
datasheet of the GPU its name matches adds what a YAML does not say (FP8 peak, power cap, SM
count). Published tables name a GPU loosely ("A100-SXM-80GB (Selene DGX A100)", "H100 96GB HBM2e
(500W, Grand Teton)", "H200 141GB"): `cluster_for` turns such a name and a GPU count into a
ClusterConfig of datasheet figures plus interconnect defaults, so that rows from any source are
estimated on the same footing. Every figure is a vendor datasheet number (dense, no sparsity).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Optional

from workbench.config import ClusterConfig
from workbench.plan.cost.measured import Measured

GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one accelerator and its usual node."""

    name: str
    peak_bf16_flops: float  # dense tensor-core BF16/FP16, per device
    peak_fp8_flops: float  # dense FP8 (0 where the device has none)
    peak_fp32_flops: float
    hbm_bytes: float
    hbm_bw_bytes_per_s: float
    intra_node_gbps: float  # GB/s one direction per device (NVLink / PCIe)
    inter_node_gbps: float  # GB/s one direction per device (its NIC share)
    gpus_per_node: int = 8
    power_capped: bool = False  # runs below its datasheet TDP: sustained clocks are lower
    sm_count: int = 0  # streaming multiprocessors (GEMM wave quantization); 0: not modelled
    # The cluster's own measured curves (workbench/profile); None: datasheet figures only.
    measured: Optional[Measured] = field(default=None, compare=False, repr=False)


# Sources: NVIDIA A100 datasheet (312 TFLOP/s BF16, 19.5 FP32; 40GB 1,555 GB/s, 80GB 2,039 GB/s;
# NVLink3 600 GB/s bidirectional); H100 datasheet (SXM5 989 TFLOP/s BF16, 1,979 FP8, 67 FP32,
# 3.35 TB/s HBM3, NVLink4 900 GB/s bidirectional; PCIe 756 / 1,513 TFLOP/s, 2.0 TB/s, PCIe Gen5
# 64 GB/s one way); H200 datasheet (989 BF16, 141 GB at 4.8 TB/s). NICs: HDR IB 200 Gb/s = 25 GB/s
# and NDR 400 Gb/s = 50 GB/s per GPU (one NIC per GPU in DGX / Grand Teton nodes). SMs: A100 108,
# H100 SXM 132 and PCIe 114 (the A100 and H100 whitepapers); V100/T4 left 0 (not checked).
GPUS: dict[str, GpuSpec] = {
    "A100-SXM-40GB": GpuSpec("A100-SXM-40GB", 312e12, 0.0, 19.5e12, 40 * GIB, 1.555e12,
                             300.0, 25.0, sm_count=108),
    "A100-SXM-80GB": GpuSpec("A100-SXM-80GB", 312e12, 0.0, 19.5e12, 80 * GIB, 2.039e12,
                             300.0, 25.0, sm_count=108),
    "H100-SXM-80GB": GpuSpec("H100-SXM-80GB", 989e12, 1979e12, 67e12, 80 * GIB, 3.35e12,
                             450.0, 50.0, sm_count=132),
    "H100-PCIe-80GB": GpuSpec("H100-PCIe-80GB", 756e12, 1513e12, 51e12, 80 * GIB, 2.0e12,
                              64.0, 50.0, sm_count=114),
    # Meta Grand Teton H100 with 96GB HBM2e run at 500 W (torchtitan benchmarks): SXM peak
    # figures, but power-capped, so the achieved-peak coefficient defaults lower. Its memory is
    # HBM2e at 2.4 TB/s, not the 80GB part's HBM3 at 3.35 TB/s (torchtitan
    # benchmarks/llama3_h100_202412_torchtitan.md and asyncTP_llama3_h100_2025-06, "Hardware").
    "H100-SXM-96GB": GpuSpec("H100-SXM-96GB", 989e12, 1979e12, 67e12, 96 * GIB, 2.4e12,
                             450.0, 50.0, power_capped=True, sm_count=132),
    "H200-SXM-141GB": GpuSpec("H200-SXM-141GB", 989e12, 1979e12, 67e12, 141e9, 4.8e12,
                              450.0, 50.0, sm_count=132),
    # Older pools of mixed clusters (AMP's AWS experiments): V100 SXM2 datasheet (125 TFLOP/s
    # FP16 tensor, 15.7 FP32, 16 GB HBM2 at 900 GB/s, NVLink2 300 GB/s bidirectional); T4
    # datasheet (65 TFLOP/s FP16 tensor, 8.1 FP32, 16 GB GDDR6 at 320 GB/s, PCIe Gen3 x16
    # 32 GB/s bidirectional). No BF16 on
    # either: the 16-bit figures are FP16. NICs: AWS P3.8xlarge 10 Gb/s and G4dn.12xlarge
    # 50 Gb/s per node of 4 GPUs.
    "V100-SXM2-16GB": GpuSpec("V100-SXM2-16GB", 125e12, 0.0, 15.7e12, 16 * GIB, 0.9e12,
                              150.0, 10 / 8 / 4, gpus_per_node=4),
    "T4-16GB": GpuSpec("T4-16GB", 65e12, 0.0, 8.1e12, 16 * GIB, 0.32e12, 16.0, 50 / 8 / 4,
                       gpus_per_node=4),
}


def match_gpu(name: str) -> GpuSpec:
    """The spec for a loosely written GPU name; KeyError (with the known names) if none fits.

    Why loose: published tables write "A100 80GB", "A100-SXM-80GB (Selene)", "H100 (80GB)",
    "H100 94-95GB HBM2e"; a planner that only took exact keys would reject most real rows.
    """
    text = (name or "").upper()
    if text in (k.upper() for k in GPUS):
        return GPUS[next(k for k in GPUS if k.upper() == text)]
    mem = [int(m) for m in re.findall(r"(\d{2,3})\s*-?\s*GB", text)]
    if "A100" in text:
        return GPUS["A100-SXM-40GB" if mem and max(mem) <= 40 else "A100-SXM-80GB"]
    if "H200" in text:
        return GPUS["H200-SXM-141GB"]
    if "H100" in text:
        if "PCIE" in text:
            return GPUS["H100-PCIe-80GB"]
        if (mem and max(mem) >= 90) or "500W" in text or "LOWER TDP" in text:
            return GPUS["H100-SXM-96GB"]
        return GPUS["H100-SXM-80GB"]
    if "V100" in text:
        return GPUS["V100-SXM2-16GB"]
    if re.search(r"\bT4\b", text):
        return GPUS["T4-16GB"]
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (matched loosely)")


def hardware_for(cluster: ClusterConfig) -> GpuSpec:
    """The hardware the cost model prices a cluster's GPUs with: every planner path asks this
    one function, so where the figures come from is decided here. The cluster's own figures
    (its YAML, or cluster_for's datasheet copy), with the FP8 peak, power cap and SM count of
    the datasheet GPU its name matches (none where it matches none) unless the YAML gives them."""
    try:
        fp8 = match_gpu(cluster.gpu).peak_fp8_flops
        capped = match_gpu(cluster.gpu).power_capped
        sms = match_gpu(cluster.gpu).sm_count
    except KeyError:
        fp8, capped, sms = 0.0, False, 0
    fp8 = float(getattr(cluster, "peak_fp8_flops", 0.0) or 0.0) or fp8  # the YAML's, if given
    sms = int(getattr(cluster, "sm_count", 0) or 0) or sms
    peak16 = float(cluster.peak_bf16_flops)
    return GpuSpec(cluster.gpu, peak16, fp8 or peak16, float(cluster.peak_fp32_flops),
                   float(cluster.hbm_bytes), float(cluster.hbm_bw_bytes_per_s),
                   float(cluster.intra_node_gbps), float(cluster.inter_node_gbps),
                   int(cluster.gpus_per_node), capped, sms,
                   Measured.of(cluster.profile) if cluster.profile is not None else None)


def cluster_for(gpu_name: str, n_gpus: int, gpus_per_node: int | None = None,
                coeff: dict[str, float] | None = None) -> ClusterConfig:
    """A ClusterConfig for n_gpus of a loosely named GPU, with its usual node size and NICs."""
    spec = match_gpu(gpu_name)
    g = int(gpus_per_node or spec.gpus_per_node)
    return ClusterConfig(name=spec.name, gpu=spec.name, device="cuda",
                         nodes=max(1, -(-int(n_gpus) // g)), gpus_per_node=g,
                         peak_bf16_flops=spec.peak_bf16_flops,
                         peak_fp32_flops=spec.peak_fp32_flops, hbm_bytes=spec.hbm_bytes,
                         hbm_bw_bytes_per_s=spec.hbm_bw_bytes_per_s,
                         intra_node_gbps=spec.intra_node_gbps,
                         inter_node_gbps=spec.inter_node_gbps, coeff=dict(coeff or {}))


def hardware_for_pool(gpu_name: str, figures: dict[str, float], gpus_per_node: int = 0
                      ) -> GpuSpec:
    """A pool's GpuSpec: the datasheet of its loosely named GPU with the figures it gives
    (names of GpuSpec fields) put over it; a GPU no name matches needs all six figures and
    gpus_per_node (KeyError otherwise, naming the known GPUs)."""
    try:
        base = match_gpu(gpu_name)
    except KeyError:
        needed = ("peak_bf16_flops", "peak_fp32_flops", "hbm_bytes", "hbm_bw_bytes_per_s",
                  "intra_node_gbps", "inter_node_gbps")
        if any(k not in figures for k in needed) or gpus_per_node < 1:
            raise
        base = GpuSpec(gpu_name, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, gpus_per_node)
    spec = replace(base, **figures)
    if gpus_per_node > 0:
        spec = replace(spec, gpus_per_node=int(gpus_per_node))
    return spec
