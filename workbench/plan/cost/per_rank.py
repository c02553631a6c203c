"""What every cost term reads: the layout columns and what they imply on one rank.

The terms (compute, communication, stages, data_parallel, memory) are written once over numpy
columns of layouts, so `estimate` on one layout and the search over millions can never
disagree. Each array here holds one value per layout; model and hardware figures are scalars.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from workbench.plan.cost.activations import (
    activation_bytes_per_token,
    op_policy_items,
    recompute_fractions,
)
from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.columns import Columns, Schedule
from workbench.plan.cost.gemm_fill import dim_fill
from workbench.plan.cost.hardware import GpuSpec
from workbench.plan.cost.measured import Level, Measured
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software

Arrays = dict[str, np.ndarray]
PipeLayers = tuple[np.ndarray, np.ndarray, np.ndarray]  # on the first, a middle, the last rank


@dataclass(frozen=True)
class PerRank:
    """The layouts' columns and what they imply on one rank of the fullest pipeline stage."""

    cols: Columns
    shard_ranks: np.ndarray  # the parameter-sharding group: dp_shard (x cp where Software says)
    reduce_ranks: np.ndarray  # the gradient all-reduce group: dp_replicate (x cp in Megatron-Core)
    reduce_stride: np.ndarray  # its ranks' distance: tp when CP ranks joined it (next to TP)
    tokens: np.ndarray  # tokens of one micro-batch on one rank (GEMM rows)
    layers_most: np.ndarray  # layers on the fullest pipeline rank
    pipe_layers: PipeLayers  # layers on the first, a middle and the last pipeline rank
    virtual: np.ndarray  # virtual stages the schedule interleaves (1 unless interleaved)
    row_fill: np.ndarray  # GEMM efficiency kept at `tokens` rows (gemm_fill.dim_fill)
    activations: Arrays  # activation bytes per token and layer (activation_bytes_per_token)
    full_share: np.ndarray  # share of layers fully recomputed (recompute_fractions)
    core_recompute: np.ndarray  # 1 where only the attention core is recomputed
    op_policy: np.ndarray  # 1 where the op policy (selective_op) checkpoints every layer
    op_redo_share: float  # the op policy's share of a block's GEMM FLOPs redone
    op_kept_bytes: np.ndarray  # ... and the bytes per token and layer it keeps
    peak_flops: float  # dense FLOP/s in the compute precision
    tile_sms: float  # SMs GEMM tiles are quantized over (0: the smooth mm_dim_half curve)
    hbm_bytes_per_s: float  # achieved HBM bandwidth
    elem_traffic: float  # elementwise HBM round trips per stored activation byte (TP-split)
    elem_traffic_rep: float  # the same for the replicated part (norms, residual adds)
    # A profiled cluster's curves, and which of its compute levels each row runs at (the ranks
    # of a layout that share a host's cores); None and () on datasheet figures.
    measured: Optional[Measured] = None
    levels: tuple[tuple[np.ndarray, Level], ...] = ()


def rank_layers(n_layers: int, pp: np.ndarray, virtual: np.ndarray, first: np.ndarray,
                last: np.ndarray, middle: np.ndarray) -> PipeLayers:
    """Layers on the first, a middle and the last pipeline rank, given the layers of the first,
    the last and the fullest middle global stage (-1 in `first`: the even split). Rank r holds
    global stages r, r + pp, ...: the first rank holds stage 0 and v - 1 middle ones, the last
    the final stage and v - 1 middle ones, a middle rank v middle stages, each counted at the
    fullest middle. An even split gives every rank ceil(n_layers / (pp v)) * v layers."""
    even = first < 0
    per_stage = np.ceil(n_layers / (pp * virtual))
    first, last, middle = (np.where(even, per_stage, c) for c in (first, last, middle))
    return first + (virtual - 1) * middle, virtual * middle, last + (virtual - 1) * middle


def per_rank(shape: ModelShape, gpu: GpuSpec, coeff: Coefficients, software: Software,
             cols: Columns) -> PerRank:
    """The rank view of the layouts `cols` of `shape` on `gpu` under `software`."""
    tokens = cols["mb"] * float(shape.seq_len) / cols["cp"]
    pipe_layers = rank_layers(shape.n_layers, cols["pp"], cols["v"], cols["lf"], cols["ll"],
                              cols["lm"])
    layers_most = np.maximum(np.maximum(pipe_layers[0], pipe_layers[1]), pipe_layers[2])
    full_share, core_recompute, op_policy = recompute_fractions(cols["rc"], software)
    activations = activation_bytes_per_token(shape, software, cols["tp"], cols["sp"])
    # elementwise round trips: the fused kernels' figure, scaled for compiled or eager stacks
    # (eager norms by their own factor unless a norm kernel runs)
    elem_traffic, elem_traffic_rep = (
        coeff.elem_traffic * (coeff.compile_elem_factor if software.compiled else eager
                              if software.eager else 1.0)
        for eager in (coeff.eager_elem_factor,
                      1.0 if software.norm_kernel else coeff.eager_rep_factor))
    cp_shard = cols["cp"] if software.cp_shards_params else 1.0
    shard_ranks = cols["dps"] * cp_shard
    reduce_ranks = cols["dpr"] * (cols["cp"] / cp_shard)
    op_redo_share, op_kept_bytes = op_policy_items(shape, software, activations, cols["tp"],
                                                   cols["sp"])
    return PerRank(
        cols=cols, shard_ranks=shard_ranks, reduce_ranks=reduce_ranks,
        reduce_stride=cols["tp"] * np.where(reduce_ranks > cols["dpr"], 1.0, shard_ranks),
        tokens=tokens, layers_most=layers_most, pipe_layers=pipe_layers,
        virtual=np.where(cols["sched"] == Schedule.INTERLEAVED_1F1B, cols["v"], 1.0),
        row_fill=dim_fill(tokens, coeff.mm_dim_half), activations=activations,
        full_share=full_share, core_recompute=core_recompute, op_policy=op_policy,
        op_redo_share=op_redo_share, op_kept_bytes=op_kept_bytes,
        peak_flops=gpu.peak_fp32_flops if software.precision == "fp32" else gpu.peak_bf16_flops,
        tile_sms=gpu.sm_count * (coeff.gemm_tile_waves > 0),
        hbm_bytes_per_s=gpu.hbm_bw_bytes_per_s * coeff.hbm_eff, elem_traffic=elem_traffic,
        elem_traffic_rep=elem_traffic_rep, measured=gpu.measured,
        levels=tuple(gpu.measured.levels_of(world_of(cols), gpu.gpus_per_node))
        if gpu.measured else ())


def world_of(cols: Columns) -> np.ndarray:
    """The ranks busy at once where a row runs: its layout's world, or more where a `busy`
    column says other ranks ran beside it (an engine probe timed with the whole job busy)."""
    world = cols["dpr"] * cols["dps"] * cols["tp"] * cols["pp"] * cols["cp"]
    return np.maximum(world, cols["busy"]) if "busy" in cols else world
