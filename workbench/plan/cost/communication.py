"""How fast groups of ranks talk, and what tensor and context parallelism cost per layer.

A group's bandwidth is NVLink inside a node and, across nodes, the NICs of the members that
share a node (one ring per member, a rail each, as NCCL runs them), never more than NVLink; a
collective's latency takes one hop per doubling of the group (tree / ring steps). A ring
all-reduce moves 2 (n-1)/n of each rank's bytes over that bandwidth, and the part of any
collective that compute does not hide is what a step pays (`exposed_s`). Every term prices its
collectives and transfers with these; `plan --explain` prints the links, and the data-parallel
scaling study (workbench.lowrank.dp_scaling) prices its all-reduce with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.compute import Compute, attn_bwd_factor
from workbench.plan.cost.hardware import GpuSpec
from workbench.plan.cost.per_rank import PerRank
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software


def nic_rails(size: np.ndarray, stride: np.ndarray, gpu: GpuSpec) -> np.ndarray:
    """Members of a group that share a node: a group spanning nodes runs one ring per member
    (rail), each over its own NIC, so cross-node bandwidth adds up across them (NCCL)."""
    return np.clip(gpu.gpus_per_node / np.maximum(stride, 1), 1, np.maximum(size, 1))


def group_bw(size: np.ndarray, stride: np.ndarray, gpu: GpuSpec, coeff: Coefficients
             ) -> np.ndarray:
    """Bytes/s of a group of `size` ranks `stride` apart: NVLink when it fits in one node, else
    the NICs of the members on one node together, never more than NVLink."""
    intra_bw = gpu.intra_node_gbps * coeff.link_eff_intra
    inter_bw = np.minimum(gpu.inter_node_gbps * coeff.link_eff_inter
                          * nic_rails(size, stride, gpu), intra_bw)
    return np.where(size * stride <= gpu.gpus_per_node, intra_bw, inter_bw) * 1e9


def collective_link(size: np.ndarray, stride: np.ndarray, gpu: GpuSpec, coeff: Coefficients
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, latency s) of one collective over `size` ranks `stride` apart; the latency
    takes one hop per doubling of the group (tree / ring steps)."""
    per_hop = np.where(size * stride <= gpu.gpus_per_node, coeff.coll_latency_intra_s,
                       coeff.coll_latency_inter_s)
    latency = np.where(size > 1, per_hop * (1.0 + np.log2(np.maximum(size, 1))), 0.0)
    return group_bw(size, stride, gpu, coeff), latency


def ring_pass_s(ranks: np.ndarray, elems: np.ndarray, bytes_per_s: np.ndarray,
                shards: np.ndarray | float = 1.0) -> np.ndarray:
    """Seconds per element byte of one ring pass (a reduce-scatter or an all-gather) over
    `ranks` ranks: each sends and receives (n-1)/n of its elements, `elems` spread over
    `shards` ranks first (FSDP's shard of a replicated group); 0 for one rank."""
    return np.where(ranks > 1, (ranks - 1) / ranks * elems / shards / bytes_per_s, 0.0)


def allreduce_s(ranks: np.ndarray, elems: np.ndarray, bytes_per_elem: float,
                bytes_per_s: np.ndarray, latency_s: np.ndarray,
                shards: np.ndarray | float = 1.0) -> np.ndarray:
    """A ring all-reduce (a reduce-scatter, then an all-gather) of `elems` elements of
    `bytes_per_elem` bytes over `ranks` ranks, plus the collective's latency; 0 for one rank."""
    return 2 * ring_pass_s(ranks, elems, bytes_per_s, shards) * bytes_per_elem \
        + np.where(ranks > 1, latency_s, 0.0)


def exposed_s(total_s: np.ndarray, behind_s: np.ndarray, overlap: float) -> np.ndarray:
    """The part of a collective of `total_s` a step waits for when it runs beside `behind_s`
    of compute: at best `overlap` of it hidden, and never more than that compute."""
    return np.maximum(total_s * (1 - overlap), total_s - behind_s)


# The forward's share of the engine's own per-layer cost (hooks, DTensor dispatch): a third,
# as autograd's work falls (the backward runs about twice the forward's ops). A recomputed
# forward pays that share again (workbench.plan.cost.stages).
ENGINE_FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Communication:
    """Exposed seconds of one layer and micro-batch on one rank."""

    tp_s: np.ndarray  # tensor / sequence parallel collectives of one pass
    cp_fwd_s: np.ndarray  # context parallel K/V exchange, forward
    cp_bwd_s: np.ndarray  # context parallel K/V and dK/dV exchange, backward
    # The engine's own seconds per layer and micro-batch around them (measured: profile probes)
    tp_engine_s: np.ndarray | float = 0.0
    cp_engine_s: np.ndarray | float = 0.0


def communication(shape: ModelShape, gpu: GpuSpec, coeff: Coefficients, software: Software,
                  rank: PerRank, comp: Compute) -> Communication:
    """Tensor / sequence parallel and context parallel traffic of one layer."""
    tp, cp, sp, tokens = rank.cols["tp"], rank.cols["cp"], rank.cols["sp"], rank.tokens
    elem_bytes = software.act_bytes
    bw_tp, lat_tp = collective_link(tp, 1, gpu, coeff)
    # SP: 2 all-gathers + 2 reduce-scatters a pass; FP8 tensorwise gathers travel in 1 byte
    fp8_gather = software.precision == "fp8" and software.fp8_scaling == "tensorwise"
    volume = tokens * float(shape.hidden) * elem_bytes * np.where((sp > 0) & fp8_gather, 0.75,
                                                                 1.0)
    hidden = coeff.async_tp_overlap if software.async_tp else coeff.tp_overlap \
        if software.overlap_tp else 0.0
    tp_s = np.where(tp > 1, 4 * (tp - 1) / tp * volume / bw_tp
                    + np.where(sp > 0, 4, 2) * lat_tp, 0.0) * (1 - hidden)
    if software.batch_first_sp and not software.async_tp:  # 4 collectives, each a copy of vol
        tp_s = tp_s + np.where((tp > 1) & (sp > 0) & (rank.cols["mb"] > 1),
                               8 * volume / rank.hbm_bytes_per_s, 0.0)
    # ring attention: each of cp-1 steps sends this rank's K/V block to the next rank while the
    # current block is computed; only what the step's attention cannot cover is exposed
    bw_cp, lat_cp = collective_link(cp, tp, gpu, coeff)
    kv_step = tokens * 2 * shape.kv_width / tp * elem_bytes / bw_cp + lat_cp / np.maximum(cp, 2)
    attn_step = comp.attention_s / np.maximum(cp, 1)

    def ring_exposed(comm_s: np.ndarray, comp_s: np.ndarray) -> np.ndarray:
        return np.where(cp > 1, (cp - 1) * exposed_s(comm_s, comp_s, coeff.cp_overlap), 0.0)

    if software.cp_allgather:  # (cp-1) blocks in, nothing to hide behind; dK/dV the same way
        cp_fwd = cp_bwd = (cp - 1) * kv_step
    else:
        cp_fwd = ring_exposed(kv_step, attn_step)
        cp_bwd = ring_exposed(2 * kv_step, attn_bwd_factor(software) * attn_step)  # K/V, dK/dV
    return Communication(tp_s=tp_s, cp_fwd_s=cp_fwd, cp_bwd_s=cp_bwd)
