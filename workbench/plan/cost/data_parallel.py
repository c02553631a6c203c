"""Data-parallel traffic of one step: the DDP all-reduce (or a distributed optimizer's
reduce-scatter and gather) once a step, FSDP's gathers and reduce-scatter per micro-batch or,
inside a pipeline, once a step; and how much of it the step's compute hides.
"""

from __future__ import annotations

import numpy as np

from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.communication import (
    allreduce_s,
    collective_link,
    exposed_s,
    ring_pass_s,
)
from workbench.plan.cost.hardware import GpuSpec
from workbench.plan.cost.memory import gather_bytes
from workbench.plan.cost.per_rank import PerRank
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stages import Stage


def fsdp_once(gather_s: np.ndarray, reduce_s: np.ndarray, fwd_s: np.ndarray,
              bwd_s: np.ndarray, virtual: np.ndarray, overlap: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """(total, exposed) seconds of FSDP inside a pipeline schedule, given one gather and one
    reduce-scatter of the rank's stages and the seconds of one micro-batch's forward and
    backward on the rank (`virtual` stages). A stage's weights are gathered at its first forward
    and stay gathered (reshard_after_forward False: this engine, torchtitan) and its gradients
    accumulate unsharded until one reduce-scatter after its last backward
    (torch.distributed.pipelining `backward_maybe_with_nosync` turns the sync off,
    `perform_reduce_grad` runs it): once a step, whatever the micro-batch count. The gather
    hides behind the first micro-batch's forward; the reduce-scatter only behind what the rank
    still computes for its other virtual stages (nothing at one stage a rank)."""
    later_bwd = bwd_s * (virtual - 1) / virtual
    exposed = exposed_s(gather_s, fwd_s, overlap) + exposed_s(reduce_s, later_bwd, overlap)
    return gather_s + reduce_s, exposed


def data_parallel(shape: ModelShape, gpu: GpuSpec, coeff: Coefficients, software: Software,
                  rank: PerRank, stage: Stage) -> tuple[np.ndarray, np.ndarray]:
    """(total, exposed) seconds of data-parallel traffic in one step: DDP all-reduce once a
    step; FSDP gathers + reduce-scatter per micro-batch, except inside a pipeline, where they
    happen once a step (`fsdp_once`)."""
    tp, ga = rank.cols["tp"], rank.cols["ga"]
    shards, replicas = rank.shard_ranks, rank.reduce_ranks
    dp_elems = stage.shard_params * shape.dp_bytes_ratio
    overlap = coeff.dp_overlap if software.overlap_dp else 0.0
    bw_shard, lat_shard = collective_link(shards, tp, gpu, coeff)
    overlap_fsdp = overlap
    if software.dp_stack == "deepspeed_zero3":  # flat gathers: one NIC per GPU, no rails
        nic = gpu.inter_node_gbps * coeff.link_eff_inter * coeff.zero3_gather_eff * 1e9
        bw_shard = np.where(shards * tp <= gpu.gpus_per_node, bw_shard, nic)
        overlap_fsdp = coeff.zero3_overlap
    # FSDP: one ring pass per gather or reduce-scatter, a collective per block (and the ends)
    per_elem_byte = dp_elems * (shards - 1) / shards / bw_shard
    latency = lat_shard * (rank.layers_most + 1)
    gather = per_elem_byte * gather_bytes(shape, software, stage.weight_bytes)[0] + latency
    reduce = per_elem_byte * software.grad_reduce_bytes + latency
    fsdp_mb = np.where(shards > 1, 2 * gather + reduce, 0.0)  # gathered for forward and backward
    fsdp_mb_exposed = exposed_s(fsdp_mb, stage.fwd_s + stage.bwd_s + stage.recompute_s,
                                overlap_fsdp)
    once, once_exposed = fsdp_once(gather, reduce, stage.fwd_s, stage.bwd_s, rank.virtual,
                                   overlap_fsdp)
    in_pipe = (rank.cols["pp"] > 1) & (shards > 1)
    fsdp_total = np.where(in_pipe, once, ga * fsdp_mb)
    fsdp_exposed = np.where(in_pipe, once_exposed, ga * fsdp_mb_exposed)
    bw_replica, lat_replica = collective_link(replicas, rank.reduce_stride, gpu, coeff)
    if software.dist_optimizer:  # reduce-scatter behind the last backward, gather behind a fwd
        ring = ring_pass_s(replicas, dp_elems, bw_replica, shards)
        latency = np.where(replicas > 1, lat_replica, 0.0)
        reduce = ring * software.grad_reduce_bytes * (2.0 if software.zero1_allreduce else 1.0) \
            + latency
        gather = ring * stage.weight_bytes + latency
        ddp = reduce + gather
        ddp_exposed = exposed_s(reduce, stage.bwd_s, overlap) + exposed_s(gather, stage.fwd_s,
                                                                          overlap)
    else:
        ddp = allreduce_s(replicas, dp_elems, software.grad_reduce_bytes, bw_replica,
                          lat_replica, shards)
        ddp_exposed = exposed_s(ddp, stage.bwd_s, overlap)
    return fsdp_total + ddp, fsdp_exposed + ddp_exposed
