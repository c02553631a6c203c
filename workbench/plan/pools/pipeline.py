"""Pipelines over pools of different GPUs: stage costs per pool, the layer split, the step time.

A stage of a heterogeneous layout lives on one pool, so its cost is the cost model's own per-layer
terms evaluated with that pool's GpuSpec and coefficients (workbench.plan.cost.estimate.evaluate,
run on a one- and a two-layer model without a pipeline: the difference is one layer, the rest the
embedding, LM head and loss). Nothing physical is re-derived here; what is new is the pipeline
of unlike stages:

- stage s with n_s layers takes t_s = n_s c_s + e_s per micro-batch (c_s: a layer on its pool;
  e_s: the head and loss on the last stage plus its slower neighbour transfer, twice, as
  cost.stages charges a pipeline rank) and holds m_s = n_s u_s + w_s bytes (u_s: a layer's
  weights, gradients and optimizer state plus its activations times the micro-batches 1F1B keeps
  in flight on stage s, min(S - s, ga); w_s: embedding / head state, logits, buffers, fixed);
- a 1F1B step takes sum_s t_s (fill and drain) + (ga - 1) max_s t_s, which is the cost model's
  (ga + pp - 1) t for equal stages; then the slowest stage's data-parallel all-reduce and
  optimizer step, each linear in its layers;
- the split minimizes max_s t_s under every m_s <= its pool's memory. With layers alike within a
  pool this is the dynamic program over layers of workbench.plan.search.splits.balance_stages with a
  per-stage speed, solved exactly by bisection on the stage time T: stage s holds at most
  min(cap_s, floor((T - e_s) / c_s)) layers, and T is feasible when those hold every layer.

A transfer between stages on one pool uses the pool's links (communication.group_bw); between pools
it pays the cluster's link between them (workbench.plan.pools.cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from workbench.plan.cost.activations import LOSS_BYTES_PER_LOGIT
from workbench.plan.cost.columns import Columns
from workbench.plan.cost.communication import collective_link, group_bw
from workbench.plan.cost.estimate import OPTIMIZER_BYTES_PER_PARAM, evaluate
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software
from workbench.plan.pools.cluster import Pool, PoolLink

STATE = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes")


@dataclass(frozen=True)
class PoolCosts:
    """One pool's per-micro-batch costs for every base layout (arrays over the base columns:
    tp, dp, micro-batch, recompute, sequence parallel, without a pipeline)."""

    layer_s: np.ndarray  # one layer: forward, backward, recompute, TP and CP time
    ends_s: np.ndarray  # embedding lookup, LM head and loss
    layer_state_bytes: np.ndarray  # one layer's weights, gradients, optimizer state
    layer_act_bytes: np.ndarray  # one layer's stored activations of one micro-batch
    embed_state_bytes: np.ndarray
    head_state_bytes: np.ndarray
    logits_bytes: np.ndarray  # the loss's fp32 tensors (last stage only)
    buffer_bytes: np.ndarray  # the other peak extras (re-materialized layer, gathers)
    p2p_s: np.ndarray  # one activation transfer to the next stage on this pool
    p2p_bytes: np.ndarray
    dp_layer_s: np.ndarray  # exposed all-reduce time of one layer's gradients
    dp_ends_s: np.ndarray  # ... of the embedding or head (each), plus the collective latency
    opt_layer_s: np.ndarray  # optimizer step over one layer's shard
    hbm_bytes: float
    frag: float
    fixed_bytes: float
    link_eff: float


def base_columns(a: Columns) -> Columns:
    """`a` without a pipeline (the costs of one stage come from a one-stage layout)."""
    one, even = np.ones_like(a["tp"]), -np.ones_like(a["tp"])
    return {**a, "pp": one, "v": one, "sched": one, "lf": even, "ll": even, "lm": even,
            "lsum": even}


def pool_costs(ms: ModelShape, pool: Pool, sw: Software, a: Columns) -> PoolCosts:
    """Per-layer and per-end costs of the layouts `a` (with `ga`; pp ignored) on `pool`."""
    b = base_columns(a)

    def ev(n: int) -> dict[str, np.ndarray]:
        m = replace(ms, n_layers=n, lowrank_layers=ms.lowrank_layers * n / ms.n_layers)
        return evaluate(m, pool.spec, pool.coeff, sw, b)

    e1, e2 = ev(1), ev(2)
    per_mb1, per_mb2 = e1["stage_micro_batch_s"], e2["stage_micro_batch_s"]
    state1, state2 = sum(e1[k] for k in STATE), sum(e2[k] for k in STATE)
    layer_state = state2 - state1
    ends_state = np.maximum(state1 - layer_state, 0.0)
    share = ms.embed_params / max(ms.embed_params + ms.head_params, 1)
    tp, co, spec = b["tp"], pool.coeff, pool.spec
    tok = b["mb"] * ms.seq_len / b["cp"]
    logits = LOSS_BYTES_PER_LOGIT * tok * ms.vocab / tp
    p2p_bytes = tok * ms.hidden * sw.act_bytes / tp
    p2p = p2p_bytes / group_bw(2.0 * np.ones_like(tp), tp * b["dpr"] * b["dps"], spec, co) \
        + co.p2p_latency_s
    bw_dp, lat_dp = collective_link(b["dpr"], tp, spec, co)
    dp = b["dpr"]
    keep = 1.0 - (co.dp_overlap if sw.overlap_dp else 0.0)
    per_param = np.where(dp > 1, 2 * (dp - 1) / dp * ms.dp_bytes_ratio * sw.grad_reduce_bytes
                         / bw_dp, 0.0) * keep / tp
    opt = OPTIMIZER_BYTES_PER_PARAM / (spec.hbm_bw_bytes_per_s * co.hbm_eff) / tp
    p_layer = ms.mean_layer_params()
    return PoolCosts(
        layer_s=per_mb2 - per_mb1, ends_s=np.maximum(2 * per_mb1 - per_mb2, 0.0),
        layer_state_bytes=layer_state, layer_act_bytes=e2["mem_activations_bytes"]
        - e1["mem_activations_bytes"], embed_state_bytes=ends_state * share,
        head_state_bytes=ends_state * (1 - share), logits_bytes=logits,
        buffer_bytes=np.maximum(e1["mem_buffers_bytes"] - logits, 0.0), p2p_s=p2p,
        p2p_bytes=p2p_bytes, dp_layer_s=per_param * p_layer,
        dp_ends_s=per_param * max(ms.embed_params, ms.head_params) + np.where(dp > 1, lat_dp, 0),
        opt_layer_s=opt * p_layer * np.ones_like(tp), hbm_bytes=spec.hbm_bytes,
        frag=co.mem_frag, fixed_bytes=co.mem_fixed_bytes, link_eff=co.link_eff_inter)


@dataclass(frozen=True)
class Stages:
    """N layouts of up to S stages as (N, S) matrices; stages past a layout's last are off."""

    on: np.ndarray  # bool
    c: np.ndarray  # seconds per layer and micro-batch
    e: np.ndarray  # fixed seconds per micro-batch (ends, transfers)
    u: np.ndarray  # bytes per layer (state + in-flight activations)
    w: np.ndarray  # fixed bytes
    q: np.ndarray  # tail seconds per layer (DP all-reduce, optimizer)
    r: np.ndarray  # fixed tail seconds
    hbm: np.ndarray  # memory of the stage's GPUs
    lo: np.ndarray  # least layers (1 on middle stages, 0 on the ends)
    # u and w by part, each (N, S): the per-layer parts sum to u, the fixed ones to w (--explain)
    u_parts: dict[str, np.ndarray] = field(default_factory=dict)
    w_parts: dict[str, np.ndarray] = field(default_factory=dict)


def build(costs: list[PoolCosts], pool_idx: np.ndarray, base_idx: np.ndarray,
          cross_s: np.ndarray, ga: np.ndarray) -> Stages:
    """Stage matrices of N layouts: `pool_idx` (N, S) the pool of each stage (-1: off), `base_idx`
    (N,) the base layout, `cross_s` (N, S - 1) the transfer time of each boundary that crosses
    pools (nan where it does not: the pool's own p2p_s), `ga` (N,) micro-batches per step."""
    n, s = pool_idx.shape
    on = pool_idx >= 0
    pi = np.where(on, pool_idx, 0)
    bi = np.broadcast_to(base_idx[:, None], (n, s))

    def take(field: str) -> np.ndarray:
        return np.stack([getattr(c, field) for c in costs])[pi, bi]

    n_st = on.sum(axis=1)
    pos = np.arange(s)[None, :]
    first, last = pos == 0, pos == (n_st[:, None] - 1)
    own = np.where(on, take("p2p_s"), 0.0)
    # a boundary inside a pool: that pool's transfer; across pools: the link's (cross_s)
    bound = np.where(on[:, 1:], np.where(np.isnan(cross_s), own[:, :-1], cross_s), 0.0)
    pad = np.zeros((n, 1))
    p2p = 2 * np.maximum(np.hstack([pad, bound]), np.hstack([bound, pad]))
    inflight = np.minimum(n_st[:, None] - pos, ga[:, None]).astype(float)
    grow = 1 + np.array([c.frag for c in costs])[pi]  # the allocator's fragmentation
    u_parts = {"layer weights, gradients, optimizer": take("layer_state_bytes"),
               "layer activations in flight": inflight * take("layer_act_bytes") * grow}
    # in a pipeline every stage also holds one boundary activation in and one out (cost.memory)
    w_parts = {"embedding state": np.where(first, take("embed_state_bytes"), 0.0),
               "LM head state": np.where(last, take("head_state_bytes"), 0.0),
               "buffers: logits + loss": np.where(last, take("logits_bytes"), 0.0) * grow,
               "buffers: pipeline send/recv":
                   np.where(n_st[:, None] > 1, 2.0 * take("p2p_bytes"), 0.0) * grow,
               "buffers: other (gathers, recomputed layer)": take("buffer_bytes") * grow,
               "fixed (CUDA context, NCCL, cuBLAS)":
                   np.broadcast_to(np.array([c.fixed_bytes for c in costs])[pi], (n, s))}
    u_parts = {k: np.where(on, v, 0.0) for k, v in u_parts.items()}
    w_parts = {k: np.where(on, v, 0.0) for k, v in w_parts.items()}
    ends = (first.astype(float) + last) * take("dp_ends_s")
    return Stages(on=on, c=np.where(on, take("layer_s"), 0.0),
                  e=np.where(on, np.where(last, take("ends_s"), 0.0) + p2p, 0.0),
                  u=sum(u_parts.values()), w=sum(w_parts.values()),
                  q=np.where(on, take("dp_layer_s") + take("opt_layer_s"), 0.0),
                  r=np.where(on, ends, 0.0),
                  hbm=np.where(on, np.array([c.hbm_bytes for c in costs])[pi], np.inf),
                  lo=np.where(on & ~first & ~last, 1.0, 0.0), u_parts=u_parts, w_parts=w_parts)


def cross_time(costs: list[PoolCosts], pools: list[Pool],
               pool_links: dict[tuple[str, str], PoolLink], a_pool: int, b_pool: int,
               base_idx: np.ndarray) -> np.ndarray:
    """One activation transfer over the link from pool a to pool b (nan: the same pool)."""
    if a_pool == b_pool:
        return np.full(len(base_idx), np.nan)
    link = pool_links[(pools[a_pool].name, pools[b_pool].name)]
    eff = min(costs[a_pool].link_eff, costs[b_pool].link_eff)
    return costs[a_pool].p2p_bytes[base_idx] / (link.bytes_per_s * eff) + link.latency_s


def balance(st: Stages, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(layers per stage (N, S), feasible (N,)): the split that minimizes the slowest stage's
    time per micro-batch with every stage within its memory (see the module docstring)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(st.on, np.floor((st.hbm - st.w) / np.maximum(st.u, 1e-30)), 0.0)
    cap = np.minimum(cap, n_layers)
    ok = np.all(cap >= st.lo, axis=1) & (cap.sum(axis=1) >= n_layers)
    t_lo = np.max(np.where(st.on, st.lo * st.c + st.e, -np.inf), axis=1)
    t_hi = np.max(np.where(st.on, n_layers * st.c + st.e, -np.inf), axis=1)

    def held(t: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.floor((t[:, None] - st.e) / np.where(st.c > 0, st.c, np.inf) + 1e-9)
        return np.where(st.on, np.clip(np.nan_to_num(k, posinf=n_layers), st.lo, cap), 0.0)

    done = held(t_lo).sum(axis=1) >= n_layers
    lo, hi = t_lo.copy(), np.where(done, t_lo, t_hi)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        fits = held(mid).sum(axis=1) >= n_layers
        hi, lo = np.where(fits & ~done, mid, hi), np.where(fits | done, lo, mid)
    n = held(hi)
    for _ in range(st.on.shape[1] + 1):  # give back what bisection's slack over-assigned
        excess = n.sum(axis=1) - n_layers
        if not (excess > 0).any():
            break
        t = np.where(n > st.lo, n * st.c + st.e, -np.inf)
        j = np.argmax(t, axis=1)
        n[np.arange(len(n)), j] -= (excess > 0)
    return n, ok & (n.sum(axis=1) == n_layers)


def step(st: Stages, n: np.ndarray, ga: np.ndarray) -> dict[str, np.ndarray]:
    """Step time, its parts and per-stage memory of layouts with split `n`."""
    t = np.where(st.on, n * st.c + st.e, 0.0)
    t_max = t.max(axis=1)
    tail = np.where(st.on, n * st.q + st.r, 0.0).max(axis=1)
    pipe = t.sum(axis=1) + (ga - 1) * t_max
    mem = np.where(st.on, n * st.u + st.w, 0.0)
    return {"step_time_s": pipe + tail, "pipeline_s": pipe, "tail_s": tail,
            "stage_s": t, "stage_mem_bytes": mem,
            "fits": np.all(mem <= st.hbm, axis=1),
            "mem_frac": np.max(np.where(st.on, mem / st.hbm, 0.0), axis=1)}
