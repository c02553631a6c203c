"""The cost model's answer: predicted step time and peak memory, with breakdowns.

`evaluate` runs the terms over columns of layouts, one value per layout: compute
(workbench.plan.cost.compute), tensor- and context-parallel communication (communication), the
micro-batch of the slowest pipeline rank (stages), data-parallel traffic (data_parallel) and
memory (memory); `estimate` does it for one Layout and returns an Estimate, logged beside the
run's measurements as `pred/<name>` so that calibration is a query. A pure function of typed
inputs: the coefficients it uses carry their provenance (coefficients), and calibration
changes them, never the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.activations import op_policy_share, recompute_fractions
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.columns import Columns, layout_columns
from workbench.plan.cost.communication import communication
from workbench.plan.cost.compute import compute
from workbench.plan.cost.data_parallel import data_parallel
from workbench.plan.cost.engine_residuals import (
    Residuals,
    residuals,
    row_residuals,
    with_residuals,
)
from workbench.plan.cost.hardware import GpuSpec, hardware_for
from workbench.plan.cost.measured_terms import (
    measured_communication,
    measured_compute,
    measured_data_parallel,
    measured_optimizer_s,
)
from workbench.plan.cost.memory import memory
from workbench.plan.cost.per_rank import Arrays, per_rank, world_of
from workbench.plan.cost.shapes import ModelShape, model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.cost.stages import Stage, stage

# Adam step traffic per parameter: read+write fp32 master (8), m (8), v (8), read the fp32
# gradient (4), write the 16-bit working copy (2), zero the gradient (4) -> bytes moved.
OPTIMIZER_BYTES_PER_PARAM = 34.0
TIME_TERMS = ("time_fwd_s", "time_bwd_s", "time_recompute_s", "time_tp_comm_s", "time_cp_comm_s",
              "time_pp_p2p_s", "time_pp_bubble_s", "time_dp_comm_exposed_s", "time_optimizer_s")
MEM_TERMS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes",
             "mem_activations_bytes", "mem_buffers_bytes", "mem_fixed_bytes")


def evaluate(shape: ModelShape, gpu: GpuSpec, coeff: Coefficients, software: Software,
             cols: Columns, engine: bool | Residuals = True) -> Arrays:
    """All time and memory terms (TIME_TERMS, MEM_TERMS, their sums step_time_s and
    peak_mem_bytes, time_dp_comm_overlapped_s, stage_micro_batch_s, inflight_layers and the
    memory buffers' parts) for the layouts in `cols`, which has its grad_accum column `ga`.
    Times are per optimizer step on one GPU of the slowest pipeline stage; memory is per GPU of
    the fullest stage. On a profiled cluster `engine` adds the engine's own measured cost
    (engine_residuals: what its probes took beyond their price, which is this without it, or
    with the given residuals of the single kinds when a composed probe is priced)."""
    rank = per_rank(shape, gpu, coeff, software, cols)
    comp = compute(shape, coeff, software, rank)
    extra: Arrays = {}
    if rank.measured is None:
        comm = communication(shape, gpu, coeff, software, rank, comp)
    else:  # a profiled cluster: the same terms, their durations measured on it
        comp = measured_compute(shape, software, rank, comp) or comp
        comm = measured_communication(shape, software, rank, gpu.gpus_per_node)
        res = None
        if isinstance(engine, Residuals):  # the single kinds', pricing a composed probe
            res = engine
        elif engine:
            res = residuals(rank.measured, shape, lambda s, c, parts: evaluate(
                s, gpu, coeff, software, c, engine=parts or False))
        if res is not None:
            extra = row_residuals(res, rank, world_of(cols))
            comp, comm = with_residuals(comp, comm, extra)
    st = stage(shape, gpu, coeff, software, rank, comp, comm)
    if rank.measured is None:
        dp_total, dp_exposed = data_parallel(shape, gpu, coeff, software, rank, st)
        optimizer_s = OPTIMIZER_BYTES_PER_PARAM * st.shard_params / rank.hbm_bytes_per_s \
            / (rank.shard_ranks * (rank.reduce_ranks if software.dist_optimizer else 1.0))
    else:
        dp_total, dp_exposed = measured_data_parallel(
            shape, coeff, software, rank, st.shard_params, st.weight_bytes, st.fwd_s, st.bwd_s,
            rank.measured.one_host, gpu.gpus_per_node)
        optimizer_s = measured_optimizer_s(rank, st.shard_params, software.dist_optimizer)
        if extra:  # the engine's update beyond the plain model's: per layer of the fullest rank
            optimizer_s = optimizer_s + rank.layers_most * extra["opt_layer"] + extra["opt_step"]
        if extra:  # the data-parallel kinds' engine cost, per layer: FSDP's per micro-batch
            in_pipe = cols["pp"] > 1  # (once a step in a pipeline), replication's once a step
            engine_dp = rank.layers_most * (np.where(in_pipe, 1.0, cols["ga"]) * extra["fsdp"]
                                            + extra["ddp"])
            dp_total, dp_exposed = dp_total + engine_dp, dp_exposed + engine_dp
    ga, per_mb = cols["ga"], st.micro_batch_s
    out: Arrays = {
        "time_fwd_s": ga * st.fwd_s, "time_bwd_s": ga * st.bwd_s,
        "time_recompute_s": ga * st.recompute_s, "time_tp_comm_s": ga * st.tp_s,
        "time_cp_comm_s": ga * st.cp_s, "time_pp_p2p_s": _p2p_exposed(st, ga, software),
        "time_pp_bubble_s": (st.fill_s if st.fill_s is not None else (cols["pp"] - 1) * per_mb)
        / rank.virtual,
        "time_dp_comm_exposed_s": dp_exposed,
        "time_optimizer_s": optimizer_s,
    }
    out["step_time_s"] = sum(out[k] for k in TIME_TERMS)
    out["time_dp_comm_overlapped_s"] = dp_total - dp_exposed
    out.update(memory(shape, coeff, software, rank, st))
    out["peak_mem_bytes"] = sum(out[k] for k in MEM_TERMS)
    out["stage_micro_batch_s"] = per_mb
    return out


def _p2p_exposed(st: Stage, ga: np.ndarray, software: Software) -> np.ndarray:
    """Pipeline transfers on the step's path: every micro-batch's where the stack waits for
    them, else one micro-batch's and, in the steady state, what each takes beyond the compute
    it runs beside (Software.p2p_overlap)."""
    if not software.p2p_overlap:
        return ga * st.p2p_s
    beside = st.micro_batch_s - st.p2p_s
    return st.p2p_s + (ga - 1) * np.maximum(st.p2p_s - beside, 0.0)


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


def flops_per_step(shape: ModelShape, global_batch: float, cols: Columns,
                   software: Software) -> tuple[float, np.ndarray]:
    """Model FLOPs and executed FLOPs (adding the recomputed forward work) of one step."""
    tokens = global_batch * shape.seq_len
    model = shape.model_flops_per_token() * tokens
    layer_fwd = 2.0 * shape.mean_layer_matmul_params() + 4.0 * shape.seq_len * shape.q_width
    full_share, core_recompute, op_policy = recompute_fractions(cols["rc"], software)
    extra = full_share * layer_fwd + core_recompute * 4.0 * shape.seq_len * shape.q_width \
        + op_policy * op_policy_share(shape, software) * 2.0 * shape.mean_layer_matmul_params()
    return model, model + extra * shape.n_layers * tokens


def estimate(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, layout: Layout,
             lowrank: LowRankConfig | None = None, *, software: Software | None = None,
             coeff: Coefficients | None = None) -> Estimate:
    """Predict one optimizer step of `layout`; the world size is the layout's (ranks fill nodes
    of cluster.gpus_per_node), the global batch is the layout's dp * micro_batch * grad_accum."""
    shape = model_shape(model, lowrank)
    gpu = hardware_for(cluster)
    software = software or software_for(train, cluster)
    cols = layout_columns([layout])
    terms = evaluate(shape, gpu, coeff or coefficients(cluster), software, cols)
    return estimate_of_row(terms, shape, gpu, software, cols, float(layout.global_batch),
                           layout.world_size, 0)


def estimate_of_row(terms: Arrays, shape: ModelShape, gpu: GpuSpec, software: Software,
                    cols: Columns, global_batch: float, world: int, row: int) -> Estimate:
    """The Estimate of row `row` of evaluated columns (`terms`: evaluate(..., cols))."""
    model_flops, hw_flops = flops_per_step(shape, global_batch, cols, software)
    step = float(terms["step_time_s"][row])
    peak = gpu.peak_fp32_flops if software.precision == "fp32" else gpu.peak_bf16_flops
    denom = step * world * peak
    return Estimate(step_time_s=step, peak_mem_bytes=float(terms["peak_mem_bytes"][row]),
                    hbm_bytes=gpu.hbm_bytes, tokens_per_s=global_batch * shape.seq_len / step,
                    mfu=model_flops / denom, hfu=float(hw_flops[row]) / denom,
                    model_flops_per_step=model_flops, hw_flops_per_step=float(hw_flops[row]),
                    world_size=world,
                    time_s={k: float(terms[k][row]) for k in TIME_TERMS},
                    mem_bytes={k: float(terms[k][row]) for k in MEM_TERMS},
                    dp_comm_overlapped_s=float(terms["time_dp_comm_overlapped_s"][row]))
