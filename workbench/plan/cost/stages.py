"""Pipeline stages: the micro-batch of the pipeline rank that sets the pace.

The stages of a pipeline are not alike: the first holds the embedding and, under 1F1B, the
most micro-batches in flight; the last holds the LM head and the loss; the middle ones hold only
layers. So the cost model times the first, a middle and the last pipeline rank apart (the
layers of each from the split columns: per_rank.rank_layers) and the slowest sets the
pipeline's per-micro-batch time; the others, summed, its fill and drain (the bubble); their
memory is itemized the same way (workbench.plan.cost.memory). Any split list is scored by its
fullest stages; which splits the planner tries is the search's (workbench.plan.search.splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.communication import (
    ENGINE_FORWARD_SHARE,
    Communication,
    collective_link,
    group_bw,
)
from workbench.plan.cost.compute import Compute
from workbench.plan.cost.hardware import GpuSpec
from workbench.plan.cost.measured_terms import measured_p2p
from workbench.plan.cost.per_rank import PerRank, PipeLayers
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software


@dataclass(frozen=True)
class Stage:
    """One micro-batch of the slowest pipeline rank (seconds), and what its parameters cost."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    recompute_s: np.ndarray
    tp_s: np.ndarray  # tensor parallel: forward, backward (same volume: Megatron f/g), recompute
    cp_s: np.ndarray  # forward ring (and its recompute), backward ring
    p2p_s: np.ndarray  # activations to / from the neighbouring stages
    micro_batch_s: np.ndarray  # all of the above
    layer_params: float  # parameters of one (mean) layer
    shard_params: np.ndarray  # parameters of one model-parallel shard (the fullest rank's)
    pipe_params: PipeLayers  # the same on the first, a middle and the last rank
    weight_bytes: float  # bytes of a working weight
    # the other pipeline ranks' micro-batch, summed: 1F1B's fill and drain (None: pp - 1 of this)
    fill_s: np.ndarray | None = None


def stage_times(pipe_layers: PipeLayers, pp: np.ndarray, layer_s: tuple[np.ndarray, ...],
                embed_s: np.ndarray, head_s: np.ndarray, head_bwd_s: np.ndarray | None = None,
                n_layers: float = 0.0) -> tuple[np.ndarray, ...]:
    """Forward, backward, recompute, tensor- and context-parallel seconds of one micro-batch on
    the pipeline rank whose micro-batch takes longest: it sets the pipeline's pace. `layer_s`
    holds those five parts for one layer; the first rank adds the embedding lookup, the last the
    head and loss (forward, and `head_bwd_s` backward: twice the forward unless measured);
    without a pipeline one rank has all."""
    single = pp <= 1
    per_layer = sum(layer_s)
    first_s = pipe_layers[0] * per_layer + 3 * (embed_s + np.where(single, head_s, 0.0))
    last_s = pipe_layers[2] * per_layer + 3 * head_s
    middle_s = np.where(pp > 2, pipe_layers[1] * per_layer, 0.0)
    last = (last_s >= first_s) & (last_s >= middle_s) & ~single
    first = ~last & (first_s >= middle_s)
    layers = np.where(last, pipe_layers[2], np.where(first, pipe_layers[0], pipe_layers[1]))
    slowest = np.maximum(np.maximum(first_s, middle_s), last_s)
    every = n_layers * per_layer + 3 * (embed_s + head_s)  # every rank's micro-batch, summed
    others = np.maximum(every - slowest, 0.0)
    fill = np.where(single, 0.0, others / np.maximum(slowest, 1e-30))
    ends = np.where(first | single, embed_s, 0.0) + np.where(last | single, head_s, 0.0)
    fwd, bwd, recompute, tp, cp = (layers * part for part in layer_s)
    if head_bwd_s is None:
        return fwd + ends, bwd + 2 * ends, recompute, tp, cp, fill
    ends_bwd = np.where(first | single, 2 * embed_s, 0.0) \
        + np.where(last | single, head_bwd_s, 0.0)
    return fwd + ends, bwd + ends_bwd, recompute, tp, cp, fill


def rank_params(pipe_layers: PipeLayers, pp: np.ndarray, layer_params: float, embed: float,
                head: float, tp: np.ndarray) -> tuple[PipeLayers, np.ndarray]:
    """Parameters of one model-parallel shard on the first rank (its layers and the embedding;
    the head too without a pipeline), a middle one and the last (the head), and the most of
    them on any rank the pipeline has."""
    first = (pipe_layers[0] * layer_params + embed + np.where(pp > 1, 0.0, head)) / tp
    middle = pipe_layers[1] * layer_params / tp
    last = (pipe_layers[2] * layer_params + head) / tp
    most = np.maximum(np.maximum(first, np.where(pp > 2, middle, 0.0)),
                      np.where(pp > 1, last, 0.0))
    return (first, middle, last), most


def stage(shape: ModelShape, gpu: GpuSpec, coeff: Coefficients, software: Software,
          rank: PerRank, comp: Compute, comm: Communication) -> Stage:
    """The terms of the pipeline rank with the longest micro-batch."""
    cols, full_share, elem_bytes = rank.cols, rank.full_share, software.act_bytes
    pp = cols["pp"]
    core = comp.attention_s + comp.core_elementwise_s
    # the op policy redoes its GEMM share and the elementwise ops, an eager core, not a fused one
    op_layer = rank.op_redo_share * comp.gemm_s + comp.elementwise_s + coeff.kernel_overhead_s \
        + (-comp.core_elementwise_s if software.flash_attention else comp.attention_s)
    recompute = full_share * comp.layer_fwd_s + rank.core_recompute * core \
        + rank.op_policy * op_layer
    # comm.tp_s is one pass's 2 collectives; the backward's count without SP is the stack's
    bwd_tp = np.where(cols["sp"] > 0, 1.0, software.tp_bwd_allreduces(shape.gated_mlp) / 2.0)
    # A fully recomputed forward runs TP's and CP's forward again as the engine runs it
    # (DTensor dispatch, the ring's steps): their engine cost's forward share, paid twice.
    # FSDP's is not: its parameters are already gathered for the backward that recomputes.
    redo = 1 + full_share * ENGINE_FORWARD_SHARE
    # the op policy redoes the SP all-gathers (half of a pass's TP traffic), keeps reductions
    tp = comm.tp_s * (1 + bwd_tp + full_share + 0.5 * rank.op_policy * (cols["sp"] > 0)) \
        + comm.tp_engine_s * redo
    cp = comm.cp_fwd_s * (1 + full_share + rank.op_policy) + comm.cp_bwd_s \
        + comm.cp_engine_s * redo
    head = comp.head_s + comp.loss_s
    if software.gathered_logits:  # all-gather of the 16-bit logits over the TP group (forward)
        bw_tp, _ = collective_link(cols["tp"], 1, gpu, coeff)
        head = head + np.where(cols["tp"] > 1, (cols["tp"] - 1) / cols["tp"] * rank.tokens
                               * shape.vocab * elem_bytes / bw_tp, 0.0)
    # the lookup's rows, written once
    embed = rank.elem_traffic * rank.tokens * rank.activations["input"] / rank.hbm_bytes_per_s
    fwd_s, bwd_s, recompute_s, tp_s, cp_s, fill = stage_times(
        rank.pipe_layers, pp, (comp.layer_fwd_s, comp.layer_bwd_s, recompute, tp, cp), embed,
        head, comp.ends_bwd_s, shape.n_layers)
    # neighbours one stage apart
    bw_pp = group_bw(2, cols["tp"] * rank.reduce_ranks * rank.shard_ranks, gpu, coeff)
    split = np.where(software.p2p_tp_split | (cols["sp"] > 0), cols["tp"], 1.0)
    p2p_bytes = rank.tokens * float(shape.hidden) * elem_bytes / split
    transfers = np.where(pp > 2, 4.0, 2.0) if software.p2p_blocking else 2.0
    p2p_s = np.where(pp > 1, transfers * rank.virtual
                     * (p2p_bytes / bw_pp + coeff.p2p_latency_s), 0.0)
    if rank.measured is not None:
        p2p_s = measured_p2p(shape, software, rank, gpu.gpus_per_node)
    layer_params = shape.mean_layer_params()
    pipe_params, shard_params = rank_params(rank.pipe_layers, pp, layer_params,
                                            shape.embed_params, shape.head_params, cols["tp"])
    per_mb = fwd_s + bwd_s + recompute_s + tp_s + cp_s + p2p_s
    return Stage(fwd_s=fwd_s, bwd_s=bwd_s, recompute_s=recompute_s, tp_s=tp_s, cp_s=cp_s,
                 p2p_s=p2p_s, micro_batch_s=per_mb, layer_params=layer_params,
                 shard_params=shard_params, pipe_params=pipe_params,
                 weight_bytes=4.0 if software.precision == "fp32" else 2.0,
                 fill_s=fill * per_mb)
