"""The stage splits the planner scores for each pipeline, and the general problem they solve.

A layout either splits n_layers evenly over its pp * virtual_stages global stages (an empty
`Layout.stage_layers`) or lists the layer count of every global stage. The stages are not alike:
the first holds the embedding and, under 1F1B, the most micro-batches in flight; the last holds
the LM head and the loss; the middle ones hold only layers. So the best split of identical
layers gives the first and last stage fewer layers, as Megatron-LM's
`--decoder-first/last-pipeline-num-layers` and torchtitan's per-stage layer counts allow.

The planner's candidates (`candidate_ends`) are the first/last parameterization Megatron-LM
exposes: first and last stage given, the middle stages splitting the rest evenly, the later ones
taking the remainder (they hold fewer micro-batches in flight). For identical layers this family
contains an optimum of the general problem, which `balance_stages` solves by dynamic programming
over per-layer costs (as AMP does, Li et al. 2022): at an optimal slowest-stage time T every
middle stage may hold floor(T) layer times, the first floor(T - its extra) and the last
floor(T - head and loss); filling first and last to their caps and spreading the rest evenly
keeps every middle stage within its cap, so the family reaches the DP's optimum whenever its
offsets include those caps (tests/test_uneven_stages.py checks it over a grid of head costs).
The DP itself stays general (per-layer time and memory, per-stage micro-batches in flight and a
memory budget) for pools whose layers or stages differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from workbench.config import ModelConfig
from workbench.plan.cost.columns import Columns
from workbench.plan.cost.shapes import model_shape

# How many layers fewer than a middle stage the first stage may hold in the planner's space (its
# extra cost is memory: the embedding's state and the most micro-batches in flight).
FIRST_OFFSETS = (0, 1, 2)


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

def with_splits(a: Columns, model: ModelConfig) -> Columns:
    """Each layout once per candidate split of its pp * v global stages (lf/ll/lm/lsum)."""
    ms = model_shape(model)
    head_layers = ms.vocab * ms.hidden / (ms.mean_layer_matmul_params()
                                         + 2.0 * ms.seq_len * ms.q_width)
    n_stages = (a["pp"] * a["v"]).astype(np.int64)
    uniq, inv = np.unique(n_stages, return_inverse=True)
    cands = [candidate_ends(model.n_layers, int(s), head_layers) for s in uniq]
    table = np.full((len(uniq), max(len(cs) for cs in cands), 4), -1.0)
    for i, (s, cs) in enumerate(zip(uniq, cands)):
        for j, (first, last) in enumerate(cs):
            table[i, j] = ends_columns(model.n_layers, int(s), first, last)
    counts = np.array([len(cs) for cs in cands])[inv]
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    out = {name: np.repeat(col, counts) for name, col in a.items()}
    at = np.repeat(inv, counts)
    for j, name in enumerate(("lf", "ll", "lm", "lsum")):
        out[name] = np.ascontiguousarray(table[at, within, j])
    return out

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
