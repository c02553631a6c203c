"""System cost model: predicted step time and peak memory of one layout, with breakdowns.

A pure function of typed inputs (model, cluster, train, layout, low-rank). The formulas live in
workbench.plan.terms and are shared with the vectorized search; the coefficients they use are in
workbench.plan.coefficients, with their provenance. Predictions are logged beside measurements as
`pred/<name>` so that calibration is a query.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.columns import Columns, layout_columns
from workbench.plan.cost.hardware import GpuSpec, hardware_for
from workbench.plan.cost.memory_terms import op_policy_share, recompute_fractions
from workbench.plan.cost.shapes import ModelShape, model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.cost.terms import MEM_TERMS, TIME_TERMS, evaluate


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one optimizer step of one layout on one cluster."""

    step_time_s: float
    peak_mem_bytes: float
    hbm_bytes: float
    tokens_per_s: float
    mfu: float  # model FLOPs (no recomputation) / (time * GPUs * dense peak)
    hfu: float  # executed FLOPs (with recomputation) / (time * GPUs * dense peak)
    model_flops_per_step: float
    hw_flops_per_step: float
    world_size: int
    time_s: dict[str, float] = field(default_factory=dict)  # sums to step_time_s
    mem_bytes: dict[str, float] = field(default_factory=dict)  # sums to peak_mem_bytes
    dp_comm_overlapped_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.fits_with()

    def fits_with(self, margin_bytes: float = 0.0, sharing: int = 1) -> bool:
        """Whether `sharing` ranks' predicted peaks (CPU ranks share one host's memory) plus the
        user's margin stay within the memory: the one rule every memory check applies."""
        return sharing * self.peak_mem_bytes + margin_bytes <= self.hbm_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.hbm_bytes - self.peak_mem_bytes

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers with units in their names, for `pred/<name>` in tracking."""
        out = {"step_time_s": self.step_time_s, "peak_mem_bytes": self.peak_mem_bytes,
               "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
               "fits": float(self.fits), "headroom_bytes": self.headroom_bytes,
               "model_flops_per_step": self.model_flops_per_step,
               "hw_flops_per_step": self.hw_flops_per_step,
               "tokens_per_s_per_gpu": self.tokens_per_s / self.world_size,
               "time_dp_comm_overlapped_s": self.dp_comm_overlapped_s}
        out.update(self.time_s)
        out.update(self.mem_bytes)
        return out


def flops_per_step(ms: ModelShape, global_batch: float, a: Columns,
                   sw: Software) -> tuple[float, np.ndarray]:
    """Model FLOPs and executed FLOPs (adding the recomputed forward work) of one step."""
    tokens = global_batch * ms.seq_len
    model = ms.model_flops_per_token() * tokens
    layer_fwd = 2.0 * ms.mean_layer_matmul_params() + 4.0 * ms.seq_len * ms.q_width
    full_frac, sel_attn, op = recompute_fractions(a["rc"], sw)
    extra = full_frac * layer_fwd + sel_attn * 4.0 * ms.seq_len * ms.q_width \
        + op * op_policy_share(ms, sw) * 2.0 * ms.mean_layer_matmul_params()
    return model, model + extra * ms.n_layers * tokens


def estimate(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, layout: Layout,
             lowrank: LowRankConfig | None = None, *, software: Software | None = None,
             coeff: Coefficients | None = None) -> Estimate:
    """Predict one optimizer step of `layout`; the world size is the layout's (ranks fill nodes
    of cluster.gpus_per_node), the global batch is the layout's dp * micro_batch * grad_accum."""
    ms = model_shape(model, lowrank)
    hw = hardware_for(cluster)
    co = coeff or coefficients(cluster)
    sw = software or software_for(train, cluster)
    a = layout_columns([layout])
    gb = float(layout.global_batch)
    t = evaluate(ms, hw, co, sw, a, gb)
    return _to_estimate(t, ms, hw, sw, a, gb, layout.world_size, 0)


def _to_estimate(t: dict[str, np.ndarray], ms: ModelShape, hw: GpuSpec, sw: Software,
                 a: Columns, gb: float, world: int, i: int) -> Estimate:
    model_f, hw_f = flops_per_step(ms, gb, a, sw)
    step = float(t["step_time_s"][i])
    peak = hw.peak_fp32_flops if sw.precision == "fp32" else hw.peak_bf16_flops
    denom = step * world * peak
    return Estimate(step_time_s=step, peak_mem_bytes=float(t["peak_mem_bytes"][i]),
                    hbm_bytes=hw.hbm_bytes, tokens_per_s=gb * ms.seq_len / step,
                    mfu=model_f / denom, hfu=float(hw_f[i]) / denom,
                    model_flops_per_step=model_f, hw_flops_per_step=float(hw_f[i]),
                    world_size=world,
                    time_s={k: float(t[k][i]) for k in TIME_TERMS},
                    mem_bytes={k: float(t[k][i]) for k in MEM_TERMS},
                    dp_comm_overlapped_s=float(t["time_dp_comm_overlapped_s"][i]))
