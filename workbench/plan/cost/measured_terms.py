"""The cost terms on a profiled cluster: the same structure as the datasheet terms (what runs, how
often, over which group), with every duration read off the cluster's measured curves.

Compute: a layer's GEMMs from the GEMM table at the rank's shapes, and what the GEMMs leave out
(attention, norms, activations, autograd) from the measured block at the same TP degree and token
count less its own GEMMs; the head GEMM and the loss likewise. Communication: each collective a
layout issues, at its payload, over its group size, inside or across nodes. On a CPU the
collectives run on the cores that compute, so none of their time hides behind compute.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.communication import Communication
from workbench.plan.cost.compute import Compute
from workbench.plan.cost.measured import GemmCurves, Level, Measured
from workbench.plan.cost.per_rank import PerRank, world_of
from workbench.plan.cost.shapes import Linear, ModelShape, block_key
from workbench.plan.cost.software import Software


def per_level(rank: PerRank, fn: Callable[[Level, np.ndarray], np.ndarray]) -> np.ndarray:
    """fn(level, rows) for the rows of each compute level, assembled into one column."""
    out = np.zeros(len(rank.tokens))
    for rows, level in rank.levels:
        out[rows] = fn(level, rows)
    return out


def _linears_s(curves: GemmCurves, linears: tuple[Linear, ...], tokens: np.ndarray,
               tp: np.ndarray, backward: bool) -> np.ndarray:
    total = np.zeros(len(tokens))
    for rows_in, cols_out, column_parallel in linears:
        k = np.full(len(tokens), float(rows_in)) if column_parallel else rows_in / tp
        n = cols_out / tp if column_parallel else np.full(len(tokens), float(cols_out))
        total = total + curves.seconds(tokens, k, n, backward)
    return total


def _gemms(shape: ModelShape, curves: GemmCurves, tokens: np.ndarray, tp: np.ndarray,
           backward: bool) -> np.ndarray:
    """One layer's GEMMs, dense and factorized blocks averaged by their share."""
    share = shape.lowrank_layers / shape.n_layers
    out = _linears_s(curves, shape.dense, tokens, tp, backward) * (1 - share)
    if share > 0:
        out = out + _linears_s(curves, shape.lowrank, tokens, tp, backward) * share
    return out


def measured_compute(shape: ModelShape, software: Software, rank: PerRank,
                     datasheet: Compute) -> Optional[Compute]:
    """Compute from the profile, or None when it has no GEMM table in this precision."""
    measured, dtype = rank.measured, software.precision
    assert measured is not None
    if any(dtype not in level.gemm for _, level in rank.levels):
        return None
    tp = rank.cols["tp"]
    key = block_key(shape)
    parts: dict[str, np.ndarray] = {}

    def fill(level: Level, rows: np.ndarray) -> None:
        curves, tok, deg = level.gemm[dtype], rank.tokens[rows], tp[rows]
        fwd, bwd = (_gemms(shape, curves, tok, deg, b) for b in (False, True))
        dense = [_linears_s(curves, shape.dense, tok, deg, b) for b in (False, True)]
        block = level.blocks.get((key, dtype))
        measured_parts = [block.seconds(p, tok, deg) for p in (1, 2, 3, 4)] if block else None
        if measured_parts is None or any(p is None for p in measured_parts):
            rest = datasheet.layer_fwd_s[rows] - datasheet.gemm_s[rows]
            measured_parts = [dense[0] + rest, dense[1] + 2 * rest, datasheet.loss_s[rows],
                              2 * datasheet.loss_s[rows]]
        block_f, block_b, loss_f, loss_b = measured_parts
        head = [curves.seconds(tok, float(shape.hidden), shape.vocab / deg, b)
                for b in (False, True)]
        values = {"gemm": fwd, "layer_fwd": fwd + np.maximum(block_f - dense[0], 0.0),
                  "layer_bwd": bwd + np.maximum(block_b - dense[1], 0.0), "head": head[0],
                  "head_bwd": head[1], "loss": loss_f, "loss_bwd": loss_b}
        for name, v in values.items():
            parts.setdefault(name, np.zeros(len(rank.tokens)))[rows] = v

    for rows, level in rank.levels:
        fill(level, rows)
    rest = np.maximum(parts["layer_fwd"] - parts["gemm"] - datasheet.attention_s, 0.0)
    return Compute(gemm_s=parts["gemm"], attention_s=np.minimum(
        datasheet.attention_s, parts["layer_fwd"] - parts["gemm"]),
        elementwise_s=rest, core_elementwise_s=np.minimum(datasheet.core_elementwise_s, rest),
        layer_fwd_s=parts["layer_fwd"], layer_bwd_s=parts["layer_bwd"], head_s=parts["head"],
        loss_s=parts["loss"], ends_bwd_s=parts["head_bwd"] + parts["loss_bwd"])


def _collective(rank: PerRank, kind: str, nbytes: np.ndarray, group: np.ndarray,
                inter: np.ndarray) -> np.ndarray:
    """A measured collective while the layout's ranks all run theirs."""
    assert rank.measured is not None
    return rank.measured.collective_s(kind, nbytes, group, inter, world_of(rank.cols))


def inter_node(size: np.ndarray, stride: np.ndarray | float, gpus_per_node: int) -> np.ndarray:
    """Whether a group of `size` ranks `stride` apart crosses nodes."""
    return np.asarray(size) * np.asarray(stride) > gpus_per_node


def measured_communication(shape: ModelShape, software: Software, rank: PerRank,
                           gpus_per_node: int) -> Communication:
    """Tensor/sequence-parallel collectives of one pass and the context-parallel K/V gather
    (forward) and dK/dV reduce-scatter (backward) of one layer, as the engine issues them."""
    m = rank.measured
    assert m is not None
    cols, tokens, elem = rank.cols, rank.tokens, software.act_bytes
    tp, cp, sp = cols["tp"], cols["cp"], cols["sp"]
    volume = tokens * float(shape.hidden) * elem
    tp_inter = inter_node(tp, 1, gpus_per_node)
    with_sp = _collective(rank, "all_gather", volume, tp, tp_inter) \
        + _collective(rank, "reduce_scatter", volume, tp, tp_inter)
    without_sp = _collective(rank, "all_reduce", volume, tp, tp_inter)
    tp_s = np.where(tp > 1, 2 * np.where(sp > 0, with_sp, without_sp), 0.0)
    kv_bytes = cp * tokens * 2 * shape.kv_width / tp * elem  # the gathered K and V
    cp_inter = inter_node(cp, tp, gpus_per_node)
    cp_fwd = np.where(cp > 1, _collective(rank, "all_gather", kv_bytes, cp, cp_inter), 0.0)
    cp_bwd = np.where(cp > 1, _collective(rank, "reduce_scatter", kv_bytes, cp, cp_inter), 0.0)
    return Communication(tp_s=tp_s, cp_fwd_s=cp_fwd, cp_bwd_s=cp_bwd)


def measured_p2p(shape: ModelShape, software: Software, rank: PerRank, gpus_per_node: int
                 ) -> np.ndarray:
    """Pipeline sends of one micro-batch: an activation forward and a gradient back per stage
    boundary the rank touches (each a measured transfer), for every virtual stage."""
    m = rank.measured
    assert m is not None
    cols = rank.cols
    split = np.where(software.p2p_tp_split | (cols["sp"] > 0), cols["tp"], 1.0)
    nbytes = rank.tokens * float(shape.hidden) * software.act_bytes / split
    stride = cols["tp"] * rank.reduce_ranks * rank.shard_ranks
    seconds = _collective(rank, "p2p", nbytes, np.full(len(nbytes), 2.0),
                             inter_node(2, stride, gpus_per_node))
    transfers = np.where(cols["pp"] > 2, 4.0, 2.0) if software.p2p_blocking else 2.0
    return np.where(cols["pp"] > 1, transfers * rank.virtual * seconds, 0.0)


def measured_data_parallel(shape: ModelShape, coeff: Coefficients, software: Software,
                           rank: PerRank, shard_params: np.ndarray, weight_bytes: float,
                           fwd_s: np.ndarray, bwd_s: np.ndarray, on_cpu: bool,
                           gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """(total, exposed) seconds of data-parallel traffic in one step: DDP's all-reduce of the
    gradients once a step; FSDP's per-block gathers (forward and backward) and reduce-scatters
    every micro-batch, once a step inside a pipeline."""
    m = rank.measured
    assert m is not None
    cols = rank.cols
    shards, replicas, ga = rank.shard_ranks, rank.reduce_ranks, cols["ga"]
    elems = shard_params * shape.dp_bytes_ratio
    overlap = 0.0 if on_cpu else (coeff.dp_overlap if software.overlap_dp else 0.0)
    calls = rank.layers_most + 1  # a collective per block and one for the ends
    shard_inter = inter_node(shards, cols["tp"], gpus_per_node)
    gather = calls * _collective(rank, "all_gather", elems / calls * weight_bytes, shards,
                                    shard_inter)
    reduce = calls * _collective(rank, "reduce_scatter", elems / calls * software.grad_reduce_bytes,
                                    shards, shard_inter)
    in_pipe = (cols["pp"] > 1) & (shards > 1)
    fsdp = np.where(shards > 1, np.where(in_pipe, gather + reduce, ga * (2 * gather + reduce)),
                    0.0)
    fsdp_exposed = np.maximum(fsdp * (1 - overlap), fsdp - ga * (fwd_s + bwd_s))
    ddp = np.where(replicas > 1, _collective(rank,
        "all_reduce", elems / shards * software.grad_reduce_bytes, replicas,
        inter_node(replicas, rank.reduce_stride, gpus_per_node)), 0.0)
    ddp_exposed = np.maximum(ddp * (1 - overlap), ddp - bwd_s)
    return fsdp + ddp, fsdp_exposed + ddp_exposed


def measured_optimizer_s(rank: PerRank, shard_params: np.ndarray, dist_optimizer: bool
                         ) -> np.ndarray:
    """The optimizer step over the parameters this rank updates, at the measured rate."""
    updated = shard_params / (rank.shard_ranks * (rank.reduce_ranks if dist_optimizer else 1.0))
    return per_level(rank, lambda level, rows: level.optimizer_s_per_param * updated[rows])


def term_sources(rank: PerRank, shape: ModelShape, precision: str) -> dict[str, str]:
    """Where each time term's durations come from, for --explain: the profile's curves (and
    which), or the datasheet and coefficients."""
    m = rank.measured
    if m is None or any(precision not in level.gemm for _, level in rank.levels):
        return {}
    tp = rank.cols["tp"]
    blocks = all((block_key(shape), precision) in level.blocks
                 and all(int(d) in level.blocks[(block_key(shape), precision)].by_tp
                         for d in tp[rows]) for rows, level in rank.levels)
    compute = "measured GEMMs" + (" + block" if blocks else " + datasheet rest of the block")
    levels = ", ".join(f"{lv.ranks} rank(s)/host" for _, lv in rank.levels)

    def curves(*kinds: str) -> str:
        spans = sorted({span for kind, span in m.comms if kind in kinds})
        return f"measured {'/'.join(kinds)} ({'/'.join(spans) or 'none'})"

    return {"time_fwd_s": f"{compute}, {levels}", "time_bwd_s": f"{compute}, {levels}",
            "time_recompute_s": f"{compute}, {levels}", "time_tp_comm_s": curves(
                "all_reduce", "all_gather", "reduce_scatter"),
            "time_cp_comm_s": curves("all_gather", "reduce_scatter"),
            "time_pp_p2p_s": curves("p2p"), "time_pp_bubble_s": "the stage times above",
            "time_dp_comm_exposed_s": curves("all_reduce", "all_gather", "reduce_scatter")
            + (", nothing hidden on a CPU" if m.one_host else ""),
            "time_optimizer_s": "measured optimizer step rate"}


def source(measured: Optional[Measured]) -> str:
    """What --explain prints as the source of a term."""
    return f"measured ({measured.source})" if measured else "datasheet and coefficients"
