"""Layouts as the planner holds them: one numpy column per field, one value per layout.

The search scores hundreds of thousands of layouts at once, so it never builds `Layout` objects
for them; this module is the one place where a layout's fields become columns (and back), and
where the recompute and pipeline-schedule names become the codes those columns hold.

Columns (all float64, one value per layout):
    dpr, dps, tp, pp, cp  parallel degrees (data replicate, data shard, tensor, pipeline, context)
    sp     1 with sequence parallel, else 0
    mb     micro-batch (sequences per forward on one data-parallel rank)
    ga     micro-batches per optimizer step (the planner derives it from the global batch, so it
           can be fractional there: such a layout breaks a rule)
    rc     a Recompute code (-1: a name that is none of them)
    sched  a Schedule code (-1: a name that is none of them)
    v      virtual pipeline stages per rank
    lf, ll, lm  layers on the first, the last and the fullest middle global stage (-1: the even
           split; workbench.plan.cost.stages says how a rank's stages are timed)
    lsum   layers the per-stage list holds (-1: the even split, or a list of the wrong shape)

"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from workbench.layout import RECOMPUTE, SCHEDULES, format_key, format_split

Columns = dict[str, np.ndarray]


class Recompute(IntEnum):
    """How much of a layer's forward the backward recomputes."""

    NONE = 0
    SELECTIVE = 1
    FULL = 2
    SELECTIVE_OP = 3  # every block, keeping some op outputs (train/parallel/recompute.py)


class Schedule(IntEnum):
    """Pipeline schedule."""

    GPIPE = 0
    ONE_F_ONE_B = 1
    INTERLEAVED_1F1B = 2


# The codes are positions in the config's spellings (workbench.layout.RECOMPUTE, SCHEDULES).
assert len(RECOMPUTE) == len(Recompute) and len(SCHEDULES) == len(Schedule)


def code(choices: tuple[str, ...], label: str) -> int:
    """The column code of a recompute or schedule name; -1 for a name that is none of them (a
    rule rejects it, naming the valid ones)."""
    return choices.index(label) if label in choices else -1


def columns(*, dpr: Any, dps: Any, tp: Any, pp: Any, cp: Any, sp: Any, mb: Any, rc: Any,
            sched: Any, v: Any, ga: Any = None, lf: Any = -1, ll: Any = -1, lm: Any = -1,
            lsum: Any = -1) -> Columns:
    """The column dict of layouts given field by field (arrays of one length, or scalars that
    every layout shares); contiguous float64, since the search runs dozens of whole-column
    operations on them. The stage split defaults to the even one."""
    given = {"dpr": dpr, "dps": dps, "tp": tp, "pp": pp, "cp": cp, "sp": sp, "mb": mb,
             "rc": rc, "sched": sched, "v": v, "lf": lf, "ll": ll, "lm": lm, "lsum": lsum}
    if ga is not None:
        given["ga"] = ga
    cols = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64).reshape(-1)
                                 for x in given.values()))
    return {k: np.ascontiguousarray(x) for k, x in zip(given, cols)}


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


def layout_columns(layouts: Iterable[Any]) -> Columns:
    """Columns of `Layout`s (anything with Layout's fields), in the order given."""
    rows = [(x.dp_replicate, x.dp_shard, x.tp, x.pp, x.cp, x.sequence_parallel, x.micro_batch,
             code(RECOMPUTE, x.recompute), code(SCHEDULES, x.pp_schedule), x.virtual_stages,
             x.grad_accum, *split_columns(x.stage_layers, x.pp * x.virtual_stages))
            for x in layouts]
    t = np.array(rows, dtype=np.float64).reshape(len(rows), 15).T
    return columns(dpr=t[0], dps=t[1], tp=t[2], pp=t[3], cp=t[4], sp=t[5], mb=t[6], rc=t[7],
                   sched=t[8], v=t[9], ga=t[10], lf=t[11], ll=t[12], lm=t[13], lsum=t[14])


def layout_fields(a: Columns, i: int) -> dict[str, Any]:
    """The `Layout` keyword arguments of row i (the inverse of layout_columns for the lists the
    planner builds: first and last stage given, the middle ones spread evenly)."""
    split = () if a["lf"][i] < 0 else split_from_ends(
        int(a["lsum"][i]), int(a["pp"][i] * a["v"][i]), int(a["lf"][i]), int(a["ll"][i]))
    return {"dp_replicate": int(a["dpr"][i]), "dp_shard": int(a["dps"][i]), "tp": int(a["tp"][i]),
            "pp": int(a["pp"][i]), "cp": int(a["cp"][i]), "sequence_parallel": bool(a["sp"][i]),
            "micro_batch": int(a["mb"][i]), "grad_accum": int(a["ga"][i]),
            "recompute": RECOMPUTE[Recompute(int(a["rc"][i]))],
            "pp_schedule": SCHEDULES[Schedule(int(a["sched"][i]))],
            "virtual_stages": int(a["v"][i]), "stage_layers": split}


def row_keys(a: Columns, rows: Sequence[int]) -> list[str]:
    """The keys of rows of planner columns: the same strings as Layout(**layout_fields(a, i))
    .key(), without building a Layout per row (a ranking's CSV keys every row of the space)."""
    rows = np.asarray(rows, dtype=np.int64)
    cols = {k: a[k][rows].astype(np.int64).tolist()
            for k in ("dpr", "dps", "tp", "pp", "cp", "sp", "mb", "ga", "rc", "sched", "v",
                      "lf", "ll", "lsum")}
    splits: dict[tuple[int, int, int, int], str] = {}
    out = []
    for j in range(len(rows)):
        pp, v, lf = cols["pp"][j], cols["v"][j], cols["lf"][j]
        split = ""
        if lf >= 0:
            ends = (cols["lsum"][j], pp * v, lf, cols["ll"][j])
            if ends not in splits:
                splits[ends] = format_split(split_from_ends(*ends))
            split = splits[ends]
        out.append(format_key(cols["dpr"][j], cols["dps"][j], cols["tp"][j], pp, cols["cp"][j],
                              bool(cols["sp"][j]), cols["mb"][j], cols["ga"][j],
                              RECOMPUTE[cols["rc"][j]], SCHEDULES[cols["sched"][j]], v, split))
    return out
