"""Uneven pipeline stages: how layers are split over the global stages of a pipeline.

A layout either splits n_layers evenly over its pp * virtual_stages global stages (an empty
`Layout.stage_layers`; then pp * virtual_stages must divide n_layers) or lists the layer count of
every global stage. The stages are not alike: the first holds the embedding and, under 1F1B, the
most micro-batches in flight; the last holds the LM head and the loss; the middle ones hold only
layers. So the best split of identical layers gives the first and last stage fewer layers, as
Megatron-LM's `--decoder-first/last-pipeline-num-layers` and torchtitan's per-stage layer counts
allow (Llama 3 405B: 7 + 14 x 8 + 7 over 16 stages).

The vectorized planner holds a split as three numbers (columns `lf`, `ll`, `lm`: layers on the
first, the last and the fullest middle stage; -1: the even split) and `lsum` (the layers the list
holds, -1 for a malformed list); any list is scored by its fullest stages. The planner's
candidates (`candidate_ends`) are the first/last parameterization Megatron-LM exposes: first and
last stage given, the middle stages splitting the rest evenly, the later ones taking the
remainder (they hold fewer micro-batches in flight). For identical layers this family contains
an optimum of the general problem, which `balance_stages` solves by dynamic programming over
per-layer costs (as AMP does, Li et al. 2022): at an optimal slowest-stage time T every middle
stage may hold floor(T) layer times, the first floor(T - its extra) and the last
floor(T - head and loss); filling first and last to their caps and spreading the rest evenly
keeps every middle stage within its cap, so the family reaches the DP's optimum whenever its
offsets include those caps (tests/test_uneven_stages.py checks it over a grid of head costs).
The DP itself stays general (per-layer time and memory, per-stage micro-batches in flight and a
memory budget) for pools whose layers or stages differ.

Imports only numpy (the engine resolves stage boundaries through workbench.layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# How many layers fewer than a middle stage the first stage may hold in the planner's space (its
# extra cost is memory: the embedding's state and the most micro-batches in flight).
FIRST_OFFSETS = (0, 1, 2)


def split_from_ends(n_layers: int, n_stages: int, first: int, last: int) -> tuple[int, ...]:
    """The list with `first` and `last` layers on the end stages and the rest spread over the
    middle ones, the later middle stages taking the remainder (they keep fewer micro-batches in
    flight under 1F1B)."""
    if n_stages == 1:
        return (n_layers,)
    if n_stages == 2:
        return (first, last)
    mid = n_stages - 2
    base, extra = divmod(n_layers - first - last, mid)
    return (first, *([base] * (mid - extra)), *([base + 1] * extra), last)


def split_problem(layers: Sequence[int], n_stages: int, n_layers: int) -> str:
    """Why a per-stage list cannot split this model (empty: it can)."""
    if len(layers) != n_stages:
        return f"has {len(layers)} entries; needs pp*virtual_stages={n_stages}"
    if any(n < 0 for n in layers) or any(n < 1 for n in layers[1:-1]):
        return "needs >= 0 layers on the first and last stage and >= 1 on every other"
    if sum(layers) != n_layers:
        return f"sums to {sum(layers)}; needs model.n_layers={n_layers}"
    return ""


def split_columns(layers: Sequence[int], n_stages: int) -> tuple[float, float, float, float]:
    """(lf, ll, lm, lsum) of one layout's list: -1s for the even split; lsum -1 when the list's
    shape is wrong for n_stages (a rule then names the problem)."""
    if not layers:
        return -1.0, -1.0, -1.0, -1.0
    if split_problem(layers, n_stages, sum(layers)):
        return 0.0, 0.0, 0.0, -1.0
    mid = layers[1:-1]
    return float(layers[0]), float(layers[-1]), float(max(mid) if mid else 0), float(sum(layers))


def candidate_ends(n_layers: int, n_stages: int, head_layers: float) -> list[tuple[int, int]]:
    """(first, last) layer counts of the splits the planner scores for n_stages global stages
    (the middle ones spread the rest, split_from_ends). With `head_layers` (the head and loss in
    layer times) rounded to r, the first stage holds 0-2 layers and the last 0 or r - 1 to
    r + 1 layers under a cap m on the middle stages, m the least that holds every layer; splits
    that another one beats on first, last and fullest middle stage at once are dropped. (-1, -1)
    is the even split, given where n_stages divides n_layers, and where no split has a layer on
    every middle stage (a rule then rejects it)."""
    if n_stages == 1 or n_stages - 2 > n_layers:
        return [(-1, -1)]
    r = max(0, round(head_layers))
    found: dict[tuple[int, int, int], None] = {}
    for d_f in FIRST_OFFSETS:
        for d_l in sorted({0, max(0, r - 1), r, r + 1}):
            m = math.ceil(n_layers / n_stages)
            while (n_stages - 2) * m + max(0, m - d_f) + max(0, m - d_l) < n_layers:
                m += 1
            first = max(0, m - d_f)
            last = n_layers - first if n_stages == 2 else max(0, m - d_l)
            rest = n_layers - first - last
            if last >= 0 and rest >= n_stages - 2:
                found[(first, last, -(-rest // (n_stages - 2)) if n_stages > 2 else 0)] = None
    keep = [c for c in found if not any(o != c and all(x <= y for x, y in zip(o, c))
                                         for o in found)]
    even = (n_layers // n_stages,) * 3 if n_layers % n_stages == 0 else None
    return [(-1, -1) if c == even or (n_stages == 2 and even and c[:2] == even[:2]) else c[:2]
            for c in keep] or [(-1, -1)]


def ends_columns(n_layers: int, n_stages: int, first: int, last: int
                 ) -> tuple[float, float, float, float]:
    """split_columns of split_from_ends(n_layers, n_stages, first, last), without the list."""
    if first < 0:
        return -1.0, -1.0, -1.0, -1.0
    mid = math.ceil((n_layers - first - last) / (n_stages - 2)) if n_stages > 2 else 0
    return float(first), float(last), float(mid), float(n_layers)


def rank_layers(n_layers: int, pp: np.ndarray, v: np.ndarray, lf: np.ndarray, ll: np.ndarray,
                lm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layers on the first, a middle and the last pipeline rank (rank r holds global stages
    r, r + pp, ...; the first rank holds stage 0 and v - 1 middle ones, the last the final stage
    and v - 1 middle ones, a middle rank v middle stages, each counted at the fullest middle).
    An even split gives every rank ceil(n_layers / (pp v)) * v layers, as before."""
    even = lf < 0
    per = np.ceil(n_layers / (pp * v))
    lf, ll, lm = (np.where(even, per, c) for c in (lf, ll, lm))
    return lf + (v - 1) * lm, v * lm, ll + (v - 1) * lm


def stage_times(ranks: tuple[np.ndarray, np.ndarray, np.ndarray], pp: np.ndarray,
                layer_s: tuple[np.ndarray, ...], embed_s: np.ndarray, head_s: np.ndarray
                ) -> tuple[np.ndarray, ...]:
    """Forward, backward, recompute, tensor- and context-parallel seconds of one micro-batch on
    the pipeline rank whose micro-batch takes longest: it sets the pipeline's pace. `layer_s`
    holds those five parts for one layer; the first rank adds the embedding lookup, the last the
    head and loss (forward, and twice that backward); without a pipeline one rank has all."""
    single = pp <= 1
    per_layer = sum(layer_s)
    t_first = ranks[0] * per_layer + 3 * (embed_s + np.where(single, head_s, 0.0))
    t_last = ranks[2] * per_layer + 3 * head_s
    t_mid = np.where(pp > 2, ranks[1] * per_layer, 0.0)
    last = (t_last >= t_first) & (t_last >= t_mid) & ~single
    first = ~last & (t_first >= t_mid)
    layers = np.where(last, ranks[2], np.where(first, ranks[0], ranks[1]))
    ends = np.where(first | single, embed_s, 0.0) + np.where(last | single, head_s, 0.0)
    fwd, bwd, rec, tp, cp = (layers * t for t in layer_s)
    return fwd + ends, bwd + 2 * ends, rec, tp, cp


def rank_memory(ranks: tuple[np.ndarray, np.ndarray, np.ndarray],
                p_ranks: tuple[np.ndarray, np.ndarray, np.ndarray], inflight: tuple[Any, ...],
                stored: np.ndarray, extra: tuple[Any, ...], bytes_per_p: np.ndarray,
                state: dict[str, np.ndarray], fixed_bytes: float, frag: float, pp: np.ndarray
                ) -> dict[str, np.ndarray]:
    """The memory terms of the fullest pipeline rank (first, a middle, last): `stored` bytes
    per layer and micro-batch times its layers and `inflight` micro-batches; `extra` bytes alive
    at its peak (logits on the last rank, the re-materialized layer); `bytes_per_p` buffer
    bytes per parameter it holds (FSDP's gathered weights); `state` bytes per parameter by term
    (weights, gradients, optimizer); a fragmentation allowance `frag` of its peak. `peak_rank`
    says which rank that is (0 first, 1 middle, 2 last), so its buffers can be itemized."""
    per_p = sum(state.values())
    choice: list[Any] = [ranks[0], p_ranks[0], inflight[0], extra[0], 0.0]
    total = None
    for i, (here, *c) in enumerate(zip((pp > 0, pp > 2, pp > 1), ranks, p_ranks, inflight,
                                       extra)):
        t = np.where(here, c[1] * (per_p + bytes_per_p * (1 + frag))
                     + (stored * c[0] * c[2] + c[3]) * (1 + frag), -np.inf)
        if total is not None:
            take = t > total
            choice = [np.where(take, new, old) for new, old in zip([*c, float(i)], choice)]
        total = t if total is None else np.maximum(total, t)
    layers, p_mp, f, ex, which = choice
    acts = stored * layers * f
    peak = acts + ex + bytes_per_p * p_mp
    return {**{k: p_mp * b for k, b in state.items()}, "mem_activations_bytes": acts,
            "mem_buffers_bytes": peak - acts, "mem_fixed_bytes": fixed_bytes + frag * peak,
            "inflight_layers": layers * f, "peak_rank": which + 0.0 * acts}


def rank_params(ranks: tuple[np.ndarray, np.ndarray, np.ndarray], pp: np.ndarray,
                p_layer: float, embed: float, head: float, tp: np.ndarray
                ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Parameters of one model-parallel shard on the first rank (its layers and the embedding;
    the head too without a pipeline), a middle one and the last (the head), and the most of
    them on any rank the pipeline has."""
    first = (ranks[0] * p_layer + embed + np.where(pp > 1, 0.0, head)) / tp
    mid, last = ranks[1] * p_layer / tp, (ranks[2] * p_layer + head) / tp
    most = np.maximum(np.maximum(first, np.where(pp > 2, mid, 0.0)), np.where(pp > 1, last, 0.0))
    return (first, mid, last), most


def inflight_per_layer(pp: np.ndarray, ga: np.ndarray, gpipe: np.ndarray, interleaved: np.ndarray,
                       vv: np.ndarray, group: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches of activations per layer held at once on the first and the second rank:
    GPipe keeps all ga; 1F1B keeps pp - r on rank r; interleaved 1F1B keeps
    2 (pp - 1 - r) + (v - 1) N + 1 model-chunk activations on rank r (its warm-up forwards and
    the first steady-state one; Narayanan et al. 2021, Megatron-Core's
    get_pipeline_parallel_order / torch's ScheduleInterleaved1F1B), N the micro-batches a rank
    runs on one virtual stage before the next (`group`; 0: pp, both stacks' default; the Llama 3
    paper's schedule sets it freely, section 3.3.2). A rank never holds more than all its ga x v
    chunk forwards (Megatron caps the warm-up at the total), so a layer holds at most ga."""
    inter = interleaved & (pp > 1)
    n = np.where(group > 0, group, pp)
    chunks = 2 * (pp - 1) + (vv - 1) * n + 1
    first = np.where(pp == 1, 1.0, np.where(gpipe, ga, np.where(
        inter, np.minimum(chunks / vv, ga), np.minimum(pp, ga))))
    second = np.where(inter, np.minimum((chunks - 2) / vv, ga),
                      np.where(gpipe, ga, np.minimum(pp - 1, ga)))
    return first, second


def balance_stages(layer_s: Sequence[float], n_stages: int, *, first_extra_s: float = 0.0,
                   last_extra_s: float = 0.0, layer_bytes: Sequence[float] | None = None,
                   layer_act_bytes: Sequence[float] | None = None,
                   inflight: Sequence[float] | None = None,
                   stage_bytes: Sequence[float] | None = None,
                   budget_bytes: float = math.inf) -> tuple[tuple[int, ...], float]:
    """The contiguous split of layers over n_stages that minimizes the slowest stage's time
    per micro-batch (its layers, plus first_extra_s on the first stage and last_extra_s on the
    last) with every stage within budget_bytes: (layers per stage, that time), or ((), inf) when
    no split fits. Stage k's memory: stage_bytes[k] (embedding, head, buffers) + its layers'
    layer_bytes (weights, gradients, optimizer state) + inflight[k] x their layer_act_bytes
    (activations of one micro-batch; under 1F1B stage k of a pp-stage pipeline keeps pp - k).
    First and last stages may be empty, middle ones hold a layer. O(n_stages * n_layers^2)."""
    n = len(layer_s)

    def prefix(x: Sequence[float] | None) -> list[float]:
        return [0.0, *np.cumsum(np.asarray(x if x is not None else np.zeros(n), float))]

    t, w, act = prefix(layer_s), prefix(layer_bytes), prefix(layer_act_bytes)
    fixed = list(stage_bytes) if stage_bytes is not None else [0.0] * n_stages
    mult = list(inflight) if inflight is not None else [1.0] * n_stages
    inf = math.inf
    # best[k][j]: the least max time with layers 0..j-1 on stages 0..k-1; cut[k][j]: where
    # stage k-1 starts in it
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        s = k - 1
        extra = (first_extra_s if s == 0 else 0.0) + (last_extra_s if s == n_stages - 1 else 0.0)
        least = 0 if s in (0, n_stages - 1) else 1
        for j in range(n + 1) if k < n_stages else (n,):
            for i in range(j - least, -1, -1):  # stage s holds layers i..j-1
                seg = t[j] - t[i] + extra
                mem = fixed[s] + w[j] - w[i] + mult[s] * (act[j] - act[i])
                if seg >= best[k][j] or mem > budget_bytes:
                    break  # a longer stage is slower and fuller still
                cand = max(best[k - 1][i], seg)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    if best[n_stages][n] == inf:
        return (), inf
    split, j = [], n
    for k in range(n_stages, 0, -1):
        split.append(j - cut[k][j])
        j = cut[k][j]
    return tuple(reversed(split)), best[n_stages][n]


def fsdp_once(ag_s: np.ndarray, rs_s: np.ndarray, fwd_s: np.ndarray, bwd_s: np.ndarray,
              vv: np.ndarray, ov: float) -> tuple[np.ndarray, np.ndarray]:
    """(total, exposed) seconds of FSDP inside a pipeline schedule, given one gather and one
    reduce-scatter of the rank's stages (`ag_s`, `rs_s`) and the seconds of one micro-batch's
    forward and backward on the rank (`fwd_s`, `bwd_s`; `vv` virtual stages). A stage's
    weights are gathered at its first forward and stay gathered (reshard_after_forward False:
    this engine, torchtitan) and its gradients accumulate unsharded until one reduce-scatter
    after its last backward (torch.distributed.pipelining `backward_maybe_with_nosync` turns
    the sync off, `perform_reduce_grad` runs it): once a step, whatever the micro-batch count.
    The gather hides behind the first micro-batch's forward; the reduce-scatter only behind
    what the rank still computes for its other virtual stages (nothing at one stage a rank)."""
    later_bwd = bwd_s * (vv - 1) / vv
    exposed = np.maximum(ag_s * (1 - ov), ag_s - fwd_s) \
        + np.maximum(rs_s * (1 - ov), rs_s - later_bwd)
    return ag_s + rs_s, exposed
