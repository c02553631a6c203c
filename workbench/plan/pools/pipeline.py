"""Pipelines over pools of different GPUs: the stages' costs, the layer split, the step time.

Each stage's replicas sit on one pool or, for a mixed stage, on several (workbench.plan.pools
.placement); every member pool prices the stage with its own per-layer costs
(workbench.plan.pools.costs). Nothing physical is re-derived here; what is new is the pipeline of
unlike stages:

- member k of stage s with n_s layers takes t_sk = n_s c_sk + e_sk per micro-batch (c: a layer
  on its pool; e: the head and loss on the last stage plus the stage's slower neighbour
  transfer, twice, as cost.stages charges a pipeline rank) and holds m_sk = n_s u_sk + w_sk
  bytes of its GPUs' memory (u: a layer's weights, gradients and optimizer state plus its
  activations times the micro-batches 1F1B keeps in flight on stage s, min(S - s, ga); w: the
  embedding / head state, logits, buffers, fixed); the replicas step together, so the stage
  takes t_s = max_k t_sk, the slowest replica's pace;
- a 1F1B step takes sum_s t_s (fill and drain) + (ga - 1) max_s t_s, which is the cost model's
  (ga + pp - 1) t for equal stages; then the slowest stage's data-parallel collectives and
  optimizer step, each linear in its layers; a mixed stage's gradient all-reduce runs at its
  slowest hop: each member pool's own collective bandwidth and the link between them;
- the split minimizes max_s t_s under every m_sk <= its GPUs' memory. With layers alike within
  a stage this is the dynamic program over layers of workbench.plan.search.splits.balance_stages
  with a per-stage speed, solved exactly by bisection on the stage time T: stage s holds at most
  min(cap_s, min_k floor((T - e_sk) / c_sk)) layers, and T is feasible when those hold every
  layer.

A transfer between replicas on one pool uses the pool's links (communication.group_bw); between
pools it pays the cluster's link between them (workbench.plan.pools.cluster); a boundary takes
as long as its slowest replica's transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench.plan.pools.cluster import Pool, PoolLink
from workbench.plan.pools.costs import PoolCosts
from workbench.plan.pools.placement import Members


@dataclass(frozen=True)
class LinkArrays:
    """Every ordered pair of pools' link as (P, P) arrays (the diagonal is unused)."""

    bytes_per_s: np.ndarray
    latency_s: np.ndarray

    @classmethod
    def of(cls, pools: list[Pool], links: dict[tuple[str, str], PoolLink]) -> LinkArrays:
        n = len(pools)
        bps, lat = np.ones((n, n)), np.zeros((n, n))
        for a in range(n):
            for b in range(n):
                if a != b:
                    ln = links[(pools[a].name, pools[b].name)]
                    bps[a, b], lat[a, b] = ln.bytes_per_s, ln.latency_s
        return cls(bps, lat)


@dataclass(frozen=True)
class Stages:
    """N layouts of up to S stages of up to K member pools: `on` (N, S), the rest (N, S, K);
    stages past a layout's last and members past a stage's last are off."""

    on: np.ndarray  # bool (N, S)
    mon: np.ndarray  # bool (N, S, K): member pools
    c: np.ndarray  # seconds per layer and micro-batch
    e: np.ndarray  # fixed seconds per micro-batch (ends, transfers)
    u: np.ndarray  # bytes per layer (state + in-flight activations)
    w: np.ndarray  # fixed bytes
    q: np.ndarray  # tail seconds per layer (DP collectives, optimizer)
    r: np.ndarray  # fixed tail seconds
    hbm: np.ndarray  # memory of the member's GPUs
    lo: np.ndarray  # (N, S) least layers (1 on middle stages, 0 on the ends)
    # u and w by part: the per-layer parts sum to u, the fixed ones to w (--explain)
    u_parts: dict[str, np.ndarray] = field(default_factory=dict)
    w_parts: dict[str, np.ndarray] = field(default_factory=dict)


def _boundaries(costs: list[PoolCosts], m: Members, base_idx: np.ndarray,
                links: LinkArrays) -> np.ndarray:
    """(N, S - 1) seconds of one activation transfer over each stage boundary: replica i of a
    stage sends to replica i of the next, so the boundary takes its slowest such pair."""
    p2p = np.stack([c.p2p_s for c in costs])
    sent = np.stack([c.p2p_bytes for c in costs])
    eff = np.array([c.link_eff for c in costs])
    table = sent[:, None, :] / (links.bytes_per_s * np.minimum.outer(eff, eff))[:, :, None] \
        + links.latency_s[:, :, None]
    table[np.arange(len(costs)), np.arange(len(costs))] = p2p
    n, s, k = m.pool.shape
    bound = np.zeros((n, max(s - 1, 0)))
    for ka in range(k):
        for kb in range(k):
            a, b = m.pool[:, :-1, ka], m.pool[:, 1:, kb]
            meet = (a >= 0) & (b >= 0) & (np.maximum(m.lo[:, :-1, ka], m.lo[:, 1:, kb])
                                          < np.minimum(m.hi[:, :-1, ka], m.hi[:, 1:, kb]))
            t = table[np.maximum(a, 0), np.maximum(b, 0), base_idx[:, None]]
            bound = np.where(meet, np.maximum(bound, t), bound)
    return bound


def _cross_reduce(costs: list[PoolCosts], m: Members, base_idx: np.ndarray,
                  links: LinkArrays) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, latency s) of the link hops of each stage's gradient all-reduce, (N, S): inf
    and 0 on a stage of one pool. A ring crosses the link from one member pool to the next;
    like a NIC, the link carries one ring per member of a node (the fewer of the two)."""
    eff = np.array([c.link_eff for c in costs])
    rails = np.stack([c.reduce_rails for c in costs])
    n, s, k = m.pool.shape
    bw, lat = np.full((n, s), np.inf), np.zeros((n, s))
    for ka in range(k):
        for kb in range(ka + 1, k):
            a, b = m.pool[..., ka], m.pool[..., kb]
            both = (a >= 0) & (b >= 0) & (a != b)
            ia, ib = np.maximum(a, 0), np.maximum(b, 0)
            hop = links.bytes_per_s[ia, ib] * np.minimum(eff[ia], eff[ib]) * np.minimum(
                rails[ia, base_idx[:, None]], rails[ib, base_idx[:, None]])
            bw = np.where(both, np.minimum(bw, hop), bw)
            lat = np.where(both, np.maximum(lat, links.latency_s[ia, ib]), lat)
    return bw, lat


def build(costs: list[PoolCosts], m: Members, base_idx: np.ndarray, ga: np.ndarray,
          links: LinkArrays) -> Stages:
    """Stage matrices of N layouts: `m` the member pools of each stage, `base_idx` (N,) the base
    layout (a row of the columns `costs` were priced on), `ga` (N,) micro-batches per step."""
    mon = m.pool >= 0
    on = mon.any(axis=2)
    n, s, _ = m.pool.shape
    pi = np.where(mon, m.pool, 0)
    bi = np.broadcast_to(base_idx[:, None, None], m.pool.shape)

    def take(name: str, within: str = "") -> np.ndarray:
        rows = [getattr(getattr(c, within), name) if within else getattr(c, name) for c in costs]
        if np.ndim(rows[0]) == 0:  # a figure of the pool, not of the layout
            return np.array(rows, dtype=float)[pi]
        return np.stack(rows)[pi, bi]

    n_st = on.sum(axis=1)
    pos = np.arange(s)[None, :]
    first, last = (pos == 0)[..., None], (pos == (n_st[:, None] - 1))[..., None]
    pipe = (n_st > 1)[:, None, None]
    bound = _boundaries(costs, m, base_idx, links)
    pad = np.zeros((n, 1))
    p2p = 2 * np.maximum(np.hstack([pad, bound]), np.hstack([bound, pad]))[..., None]
    inflight = np.minimum(n_st[:, None] - pos, ga[:, None]).astype(float)[..., None]
    grow = 1 + take("frag")  # the allocator's fragmentation
    layer_p, embed_p, head_p = take("layer_params"), take("embed_params"), take("head_params")
    fsdp = take("fsdp_per_param_bytes")  # FSDP in a pipeline keeps the stage's weights gathered
    u_parts = {"layer weights, gradients, optimizer": take("layer_state_bytes"),
               "layer activations in flight": inflight * take("layer_act_bytes") * grow,
               "FSDP gathered layer weights, fp32 gradients": np.where(pipe, fsdp * layer_p, 0.0)
               * grow}
    # in a pipeline every stage also holds one boundary activation in and one out (cost.memory)
    w_parts = {"embedding state": np.where(first, take("embed_state_bytes"), 0.0),
               "LM head state": np.where(last, take("head_state_bytes"), 0.0),
               "buffers: logits + loss": np.where(last, take("logits_bytes"), 0.0) * grow,
               "buffers: FSDP gathered weights": np.where(
                   pipe, fsdp * (first * embed_p + last * head_p), take("fsdp_one_bytes")) * grow,
               "buffers: pipeline send/recv": np.where(pipe, take("p2p_buffer_bytes"), 0.0)
               * grow,
               "buffers: recomputed working layer": take("buffer_bytes") * grow,
               "fixed (CUDA context, NCCL, cuBLAS)": take("fixed_bytes")}
    u_parts = {k: np.where(mon, v, 0.0) for k, v in u_parts.items()}
    w_parts = {k: np.where(mon, v, 0.0) for k, v in w_parts.items()}

    def tail(name: str) -> np.ndarray:
        return np.where(pipe, take(name, "tail_pipe"), take(name, "tail_one"))

    # the replicate all-reduce at the stage's slowest hop: its pools' own and the link's
    cross_bw, cross_lat = _cross_reduce(costs, m, base_idx, links)
    own_bw = take("reduce_bw")
    slowest = np.minimum(np.where(mon, own_bw, np.inf).min(axis=2), cross_bw)[..., None]
    rate = tail("reduce_per_param_s") * own_bw / slowest + tail("other_per_param_s")
    ends_p = first * embed_p + last * head_p
    return Stages(on=on, mon=mon, c=np.where(mon, take("layer_s"), 0.0),
                  e=np.where(mon, np.where(last, take("ends_s"), 0.0) + p2p, 0.0),
                  u=sum(u_parts.values()), w=sum(w_parts.values()),
                  q=np.where(mon, rate * layer_p + tail("per_layer_s"), 0.0),
                  r=np.where(mon, rate * ends_p + tail("once_s") + cross_lat[..., None], 0.0),
                  hbm=np.where(mon, take("hbm_bytes"), np.inf),
                  lo=np.where(on & (pos > 0) & (pos < n_st[:, None] - 1), 1.0, 0.0),
                  u_parts=u_parts, w_parts=w_parts)


def _over_members(f: np.ufunc, x: np.ndarray) -> np.ndarray:
    """f (np.minimum or np.maximum) over the member axis: slice by slice, as numpy reduces a
    short last axis several times slower (the bisection below does it 60 times)."""
    out = x[..., 0]
    for k in range(1, x.shape[-1]):
        out = f(out, x[..., k])
    return out


def stage_time(st: Stages, n: np.ndarray) -> np.ndarray:
    """(N, S) seconds per micro-batch of stages of `n` layers: their slowest member's."""
    return _over_members(np.maximum, np.where(st.mon, n[..., None] * st.c + st.e, -np.inf))


def balance(st: Stages, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(layers per stage (N, S), feasible (N,)): the split that minimizes the slowest stage's
    time per micro-batch with every member within its memory (see the module docstring)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(st.mon, np.floor((st.hbm - st.w) / np.maximum(st.u, 1e-30)), np.inf)
    cap = np.where(st.on, np.minimum(_over_members(np.minimum, cap), n_layers), 0.0)
    ok = np.all(cap >= st.lo, axis=1) & (cap.sum(axis=1) >= n_layers)
    t_lo = np.max(np.where(st.on, stage_time(st, st.lo), -np.inf), axis=1)
    t_hi = np.max(np.where(st.on, stage_time(st, np.full(st.lo.shape, float(n_layers))),
                           -np.inf), axis=1)

    def held(t: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.floor((t[:, None, None] - st.e) / np.where(st.c > 0, st.c, np.inf) + 1e-9)
        k = _over_members(np.minimum, np.where(st.mon, np.minimum(k, n_layers), np.inf))
        return np.where(st.on, np.clip(k, st.lo, cap), 0.0)

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
        t = np.where(n > st.lo, stage_time(st, n), -np.inf)
        j = np.argmax(t, axis=1)
        n[np.arange(len(n)), j] -= (excess > 0)
    return n, ok & (n.sum(axis=1) == n_layers)


def step(st: Stages, n: np.ndarray, ga: np.ndarray) -> dict[str, np.ndarray]:
    """Step time, its parts and per-member memory (N, S, K) of layouts with split `n` (N, S)."""
    t = np.where(st.on, stage_time(st, n), 0.0)
    tail = np.where(st.mon, n[..., None] * st.q + st.r, 0.0).max(axis=(1, 2))
    pipe = t.sum(axis=1) + (ga - 1) * t.max(axis=1)
    mem = np.where(st.mon, n[..., None] * st.u + st.w, 0.0)
    return {"step_time_s": pipe + tail, "pipeline_s": pipe, "tail_s": tail,
            "stage_s": t, "stage_mem_bytes": mem,
            "fits": np.all(mem <= st.hbm, axis=(1, 2)),
            "mem_frac": np.max(np.where(st.mon, mem / st.hbm, 0.0), axis=(1, 2))}
