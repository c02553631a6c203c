"""What one pool's GPUs cost per layer and per stage end: the cost model's own terms, evaluated
with that pool's GpuSpec and coefficients.

A stage of a pipeline over pools is a run of layers plus, on the first and last stage, the
embedding or the head. The cost model's `evaluate` (workbench.plan.cost.estimate), run on a one-
and a two-layer model without a pipeline, gives both: the difference is one layer, the rest the
ends. Time per micro-batch, memory by part and the activation transfer come from there, for any
tp, dp_replicate, dp_shard, cp, micro-batch, recompute and Software (stack). The once-a-step tail
(the data-parallel collectives and the optimizer step) is the cost model's `data_parallel` term,
taken with compute long enough to hide what the overlap coefficient allows: linear in a stage's
parameters, so a stage's tail is a rate per parameter plus latencies per layer and per step. Its
replicate part (the gradient all-reduce over dp_replicate) is kept apart with its bandwidth,
because on a stage whose replicas sit on two pools it runs at the slowest hop, the link
included (workbench.plan.pools.pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from workbench.plan.cost.columns import Columns
from workbench.plan.cost.communication import collective_link, group_bw, nic_rails
from workbench.plan.cost.data_parallel import data_parallel
from workbench.plan.cost.estimate import OPTIMIZER_BYTES_PER_PARAM, evaluate
from workbench.plan.cost.memory import gather_bytes
from workbench.plan.cost.per_rank import PerRank, per_rank
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stages import Stage
from workbench.plan.pools.cluster import Pool

STATE = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes")
# compute that hides every collective as far as the overlap coefficient lets it
_LONG_S = 1e30


@dataclass(frozen=True)
class Tail:
    """The once-a-step tail of a stage on one pool, per base layout: seconds per parameter of
    the stage's (the replicate all-reduce apart, at bandwidth `reduce_bw`), per layer and once."""

    reduce_per_param_s: np.ndarray  # dp_replicate all-reduce (or reduce-scatter + gather)
    other_per_param_s: np.ndarray  # FSDP's gathers and reduce-scatter, the optimizer step
    per_layer_s: np.ndarray  # latencies that grow with the layers (a collective per block)
    once_s: np.ndarray  # latencies paid once


@dataclass(frozen=True)
class PoolCosts:
    """One pool's per-micro-batch costs for every base layout (arrays over the base columns:
    tp, dp, cp, micro-batch, recompute, sequence parallel, without a pipeline)."""

    layer_s: np.ndarray  # one layer: forward, backward, recompute, TP and CP time
    ends_s: np.ndarray  # embedding lookup, LM head and loss
    layer_state_bytes: np.ndarray  # one layer's weights, gradients, optimizer state
    layer_act_bytes: np.ndarray  # one layer's stored activations of one micro-batch
    embed_state_bytes: np.ndarray
    head_state_bytes: np.ndarray
    logits_bytes: np.ndarray  # the loss's fp32 tensors (last stage only)
    buffer_bytes: np.ndarray  # the other peak extras (re-materialized layer)
    fsdp_one_bytes: np.ndarray  # FSDP's gathered block, without a pipeline
    fsdp_per_param_bytes: np.ndarray  # in a pipeline: gathered weights + fp32 grads, per param
    p2p_s: np.ndarray  # one activation transfer to the next stage on this pool
    p2p_bytes: np.ndarray  # what one transfer sends
    p2p_buffer_bytes: np.ndarray  # the boundary activations a stage holds (one in, one out)
    reduce_bw: np.ndarray  # bytes/s of the dp_replicate group's collectives on this pool
    reduce_rails: np.ndarray  # rings that group runs side by side (NICs of a node it uses)
    tail_pipe: Tail  # inside a pipeline (FSDP gathers once a step)
    tail_one: Tail  # a single stage (FSDP gathers per micro-batch)
    layer_params: float  # parameters of one layer and of the ends (the tails' multipliers)
    embed_params: float
    head_params: float
    tp: np.ndarray
    hbm_bytes: float
    frag: float
    fixed_bytes: float
    link_eff: float


def base_columns(a: Columns) -> Columns:
    """`a` without a pipeline (the costs of one stage come from a one-stage layout)."""
    one, even = np.ones_like(a["tp"]), -np.ones_like(a["tp"])
    return {**a, "pp": one, "v": one, "sched": one, "lf": even, "ll": even, "lm": even,
            "lsum": even}


def _exposed(ms: ModelShape, pool: Pool, sw: Software, rank: PerRank, params: float,
             layers: float, in_pipe: bool, shard_only: bool) -> np.ndarray:
    """data_parallel's exposed seconds for a stage of `params` parameters over `layers` layers
    (one tp shard holds params / tp), behind compute long enough to hide the most it can."""
    ones = np.ones_like(rank.cols["tp"])
    r = replace(rank, cols={**rank.cols, "pp": ones * (2.0 if in_pipe else 1.0)},
                layers_most=ones * layers,
                reduce_ranks=ones if shard_only else rank.reduce_ranks)
    long = ones * _LONG_S
    st = Stage(fwd_s=long, bwd_s=long, recompute_s=0 * ones, tp_s=0 * ones, cp_s=0 * ones,
               p2p_s=0 * ones, micro_batch_s=long, layer_params=ms.mean_layer_params(),
               shard_params=params / rank.cols["tp"], pipe_params=(ones, ones, ones),
               weight_bytes=4.0 if sw.precision == "fp32" else 2.0)
    return data_parallel(ms, pool.spec, pool.coeff, sw, r, st)[1]


def _tail(ms: ModelShape, pool: Pool, sw: Software, rank: PerRank, in_pipe: bool) -> Tail:
    """The cost model's data-parallel term as rates: it is linear in the parameters a stage
    holds and in its layers (one collective per block), so three evaluations give it."""
    def f(params: float, layers: float) -> tuple[np.ndarray, np.ndarray]:
        whole = _exposed(ms, pool, sw, rank, params, layers, in_pipe, False)
        shard = _exposed(ms, pool, sw, rank, params, layers, in_pipe, True)
        return whole - shard, shard

    p = ms.mean_layer_params()
    (red0, sh0), (red_p, sh_p), (red_l, sh_l) = f(0.0, 0.0), f(p, 0.0), f(0.0, 1.0)
    dist = rank.reduce_ranks if sw.dist_optimizer else 1.0
    opt = OPTIMIZER_BYTES_PER_PARAM / rank.hbm_bytes_per_s / (rank.cols["tp"]
                                                               * rank.shard_ranks * dist)
    return Tail(reduce_per_param_s=(red_p - red0) / p, other_per_param_s=(sh_p - sh0) / p + opt,
                per_layer_s=(red_l - red0) + (sh_l - sh0), once_s=red0 + sh0)


def pool_costs(ms: ModelShape, pool: Pool, sw: Software, a: Columns) -> PoolCosts:
    """Per-layer and per-end costs of the layouts `a` (with `ga`; pp ignored) on `pool`."""
    b = base_columns(a)

    def ev(n: int) -> dict[str, np.ndarray]:
        m = replace(ms, n_layers=n, lowrank_layers=ms.lowrank_layers * n / ms.n_layers)
        return evaluate(m, pool.spec, pool.coeff, sw, b)

    e1, e2 = ev(1), ev(2)
    rank = per_rank(ms, pool.spec, pool.coeff, sw, b)
    per_mb1, per_mb2 = e1["stage_micro_batch_s"], e2["stage_micro_batch_s"]
    state1, state2 = sum(e1[k] for k in STATE), sum(e2[k] for k in STATE)
    layer_state = state2 - state1
    ends_state = np.maximum(state1 - layer_state, 0.0)
    share = ms.embed_params / max(ms.embed_params + ms.head_params, 1)
    tp, co, spec = b["tp"], pool.coeff, pool.spec
    tok = rank.tokens
    logits = e1["mem_buf_logits_bytes"]  # the loss's tensors, as the stack keeps them
    # a stage sends its output as the stack's pipeline leaves it (cost.stages): split over the
    # TP ranks where the stack scatters it or sequence parallelism already has
    split = np.where(sw.p2p_tp_split | (b["sp"] > 0), tp, 1.0)
    p2p_bytes = tok * ms.hidden * sw.act_bytes / split
    group = tp * rank.reduce_ranks * rank.shard_ranks
    p2p = p2p_bytes / group_bw(2.0 * np.ones_like(tp), group, spec, co) + co.p2p_latency_s
    reduce_bw, _ = collective_link(rank.reduce_ranks, rank.reduce_stride, spec, co)
    sharded = rank.shard_ranks > 1
    gather_model = gather_bytes(ms, sw, 4.0 if sw.precision == "fp32" else 2.0)[0]
    fsdp_one = e1["mem_buf_fsdp_bytes"]
    return PoolCosts(
        layer_s=per_mb2 - per_mb1, ends_s=np.maximum(2 * per_mb1 - per_mb2, 0.0),
        layer_state_bytes=layer_state, layer_act_bytes=e2["mem_activations_bytes"]
        - e1["mem_activations_bytes"], embed_state_bytes=ends_state * share,
        head_state_bytes=ends_state * (1 - share), logits_bytes=logits,
        buffer_bytes=np.maximum(e1["mem_buffers_bytes"] - logits - fsdp_one, 0.0),
        fsdp_one_bytes=fsdp_one, fsdp_per_param_bytes=np.where(sharded, gather_model + 4.0, 0.0)
        / tp, p2p_s=p2p, p2p_bytes=p2p_bytes,
        p2p_buffer_bytes=2.0 * tok * ms.hidden * sw.act_bytes / tp, reduce_bw=reduce_bw,
        reduce_rails=nic_rails(rank.reduce_ranks, rank.reduce_stride, spec),
        tail_pipe=_tail(ms, pool, sw, rank, True), tail_one=_tail(ms, pool, sw, rank, False),
        layer_params=ms.mean_layer_params(), embed_params=float(ms.embed_params),
        head_params=float(ms.head_params), tp=tp, hbm_bytes=spec.hbm_bytes, frag=co.mem_frag,
        fixed_bytes=co.mem_fixed_bytes, link_eff=co.link_eff_inter)
