"""Scores of the cost model against published rows, and the development / held-out split.

Every choice of a stack fact or a coefficient is made looking at some sources' rows; their
errors are then no out-of-sample test. benchmarks/calibration/splits.csv says, per source group,
which split it belongs to (`development`: its rows were looked at while something was chosen;
`held_out`: none was) and what its rows chose, with evidence. `benchmarks/costmodel_accuracy.py`
prints the figures of each split side by side: median absolute error, the median per-sweep
Spearman and top-1 regret, and OOM F1.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import ConfigError, InputError

SPLITS = ("development", "held_out")
SPLIT_COLUMNS = ("source_group", "split", "chose", "evidence")
# A sweep counts towards a split's median Spearman / regret from this many layouts.
SPLIT_SWEEP_MIN = 3
LOWER_IS_BETTER = {"seconds_per_iter"}


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation with average ranks for ties; nan when either side is constant."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else float("nan")


def regret(meas: list[float], pred: list[float], lower_better: bool) -> float:
    """How much worse (fraction) the measured figure of the predicted-best layout is than the
    measured best: 0 when the model picks the layout that measured best."""
    pick = (min if lower_better else max)(range(len(pred)), key=lambda i: pred[i])
    best = min(meas) if lower_better else max(meas)
    return abs(meas[pick] - best) / best


def oom_scores(rows: Iterable[dict[str, str]], margin_gib: float = 0.0
               ) -> tuple[int, int, int, int]:
    """(tp, fp, fn, tn) of predicting OOM (not pred_fits, or less than `margin_gib` of headroom:
    `plan --margin-gib`) on rows with a known outcome: every measured row ran; rows whose
    `outcome` says oom did not."""
    tp = fp = fn = tn = 0
    for r in rows:
        if r.get("pred_fits") not in ("true", "false"):
            continue
        oom = (r.get("outcome") or "").strip().lower() == "oom"
        pred_oom = r["pred_fits"] == "false" or float(r["pred_headroom_gib"]) < margin_gib
        tp += oom and pred_oom
        fp += (not oom) and pred_oom
        fn += oom and not pred_oom
        tn += (not oom) and not pred_oom
    return tp, fp, fn, tn


def prf1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    """(precision, recall, F1) of OOM predictions; nan where a ratio has no denominator."""
    prec = tp / (tp + fp) if tp + fp else float("nan")
    rec = tp / (tp + fn) if tp + fn else float("nan")
    return prec, rec, (2 * prec * rec / (prec + rec) if tp else float("nan"))


SweepKey = tuple[str, str, str, str, str]


def sweeps_of(pairs: list[tuple[dict[str, str], float, float]], min_rows: int
              ) -> dict[SweepKey, list[tuple[float, float]]]:
    """{(source, model, GPU count, metric, GPU type): [(measured, predicted)]} of every sweep of
    >= `min_rows` priced rows. Why the GPU type: a sweep varies the layout on one machine, and a
    source that measured one model on two GPU types (mosaicml: H100 and A100) has two sweeps
    there, not one whose ranking the GPUs' speed alone would make."""
    out: dict[SweepKey, list[tuple[float, float]]] = defaultdict(list)
    for row, meas, pred in pairs:
        out[(row["source_group"], row["model"], row["n_gpus"], row["metric"],
             row.get("gpu_type") or "")].append((meas, pred))
    return {k: v for k, v in out.items() if len(v) >= min_rows}


def sweep_name(key: SweepKey, keys: Iterable[SweepKey]) -> str:
    """"MODEL n=GPUS", and the GPU type where the source has that sweep on another GPU too."""
    src, model, n, metric, gpu = key
    twins = {k[4] for k in keys if k[:4] == key[:4]}
    return f"{model} n={n}" + (f" {gpu.split(' (')[0]}" if len(twins) > 1 else "")


def read_splits(path: Path) -> dict[str, dict[str, str]]:
    """{source_group: row} of a splits CSV (columns SPLIT_COLUMNS). Why a file and not a
    constant: which rows chose what is a record kept beside the rows, with its evidence, and a
    new source must be declared there before it is scored. InputError for a missing file or
    column, ConfigError naming the line for an unknown split or a repeated source."""
    if not path.is_file():
        raise InputError(f"--splits {path}: no such file")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        missing = [c for c in SPLIT_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"--splits {path}: missing columns {', '.join(missing)} (expected "
                         f"{', '.join(SPLIT_COLUMNS)})")
    out: dict[str, dict[str, str]] = {}
    for i, row in enumerate(rows, start=2):
        src, split = (row["source_group"] or "").strip(), (row["split"] or "").strip()
        if split not in SPLITS:
            raise ConfigError(f"split (line {i} of {path.name})", split, "one of " +
                              ", ".join(SPLITS))
        if not src or src in out:
            raise ConfigError(f"source_group (line {i} of {path.name})", src,
                              "a source group named once")
        out[src] = {**row, "source_group": src, "split": split}
    return out


def check_declared(rows: Iterable[dict[str, str]], splits: dict[str, dict[str, str]],
                   path: Path) -> None:
    """ConfigError for the first row whose source group the splits file does not declare: a
    new source is scored only once it says whether its rows chose anything."""
    for row in rows:
        src = row.get("source_group") or ""
        if src not in splits:
            raise ConfigError("source_group", src, f"a source declared in {path} (add a line: "
                              "development if its rows were looked at while choosing a fact "
                              "or coefficient, else held_out)")


@dataclass(frozen=True)
class Figures:
    """A group's figures: rows priced, median |error| (%), sweeps of >= SPLIT_SWEEP_MIN
    layouts with their median Spearman and median and largest top-1 regret, OOM F1 (nan: no
    OOM labels) and the rows that ran but are predicted not to fit (false_oom of ran)."""

    rows: int
    median_err_pct: float
    sweeps: int
    median_rho: float
    median_regret: float
    max_regret: float
    oom_f1: float
    oom_labels: int
    false_oom: int
    ran: int


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def figures(pairs: list[tuple[dict[str, str], float, float]],
            preds: list[dict[str, str]]) -> Figures:
    """The Figures of one group: `pairs` its priced rows (row, measured, predicted), `preds` all
    its rows with their pred_* columns (OOM-labelled ones included)."""
    rhos, regrets = [], []
    for key, items in sweeps_of(pairs, SPLIT_SWEEP_MIN).items():
        m, p = [a for a, _ in items], [b for _, b in items]
        rho = spearman(m, p)
        if rho == rho:  # a constant side ranks nothing
            rhos.append(rho)
        regrets.append(regret(m, p, key[3] in LOWER_IS_BETTER))
    tp, fp, fn, tn = oom_scores(preds)
    return Figures(len(pairs), _median([abs(p - m) / m * 100 for _, m, p in pairs]),
                   len(regrets), _median(rhos), _median(regrets),
                   max(regrets, default=float("nan")), prf1(tp, fp, fn)[2], tp + fn, fp, fp + tn)


def by_split(pairs: list[tuple[dict[str, str], float, float]], preds: list[dict[str, str]],
             splits: dict[str, dict[str, str]]
             ) -> tuple[dict[str, Figures], dict[str, Figures]]:
    """({source: Figures}, {split: Figures}) over the scored rows."""
    src_pairs, src_preds = defaultdict(list), defaultdict(list)
    for item in pairs:
        src_pairs[item[0]["source_group"]].append(item)
    for row in preds:
        src_preds[row["source_group"]].append(row)
    per_source = {s: figures(src_pairs[s], src_preds[s]) for s in src_preds}
    per_split = {}
    for split in SPLITS:
        mine = {s for s in src_preds if splits[s]["split"] == split}
        per_split[split] = figures([x for s in mine for x in src_pairs[s]],
                                   [r for s in mine for r in src_preds[s]])
    return per_source, per_split


def _fmt(fig: Figures) -> str:
    def num(x: float, spec: str) -> str:
        return format(x, spec) if x == x else "-"

    oom = f"{num(fig.oom_f1, '.2f')} ({fig.oom_labels} OOM)" if fig.oom_labels else "-"
    reg = f"{num(fig.median_regret, '.1%')}/{num(fig.max_regret, '.1%')}"
    return (f"{fig.rows:>5} {num(fig.median_err_pct, '.1f'):>9} {fig.sweeps:>6} "
            f"{num(fig.median_rho, '+.2f'):>6} {reg:>12} {oom:<16} {fig.false_oom}/{fig.ran}")


def report_splits(pairs: list[tuple[dict[str, str], float, float]],
                  preds: list[dict[str, str]], splits: dict[str, dict[str, str]],
                  path: Path) -> dict[str, Figures]:
    """Print each source's figures under its split, then both splits overall side by side;
    return {split: Figures}."""
    per_source, per_split = by_split(pairs, preds, splits)
    head = (f"{'rows':>5} {'med|err|%':>9} {'sweeps':>6} {'rho':>6} {'regret med/max':>14} "
            f"{'OOM F1':<16} ran, predicted OOM")
    print(f"\ndevelopment and held-out figures (splits: {path.name}; rho and regret: medians "
          f"over sweeps of >= {SPLIT_SWEEP_MIN} layouts, one GPU type):")
    print(f"  {'source':<22}{'split':<13}{head}")
    for split in SPLITS:
        for src in sorted(s for s in per_source if splits[s]["split"] == split):
            print(f"  {src:<22}{split:<13}{_fmt(per_source[src])}")
    for split in SPLITS:
        print(f"  {'overall':<22}{split:<13}{_fmt(per_split[split])}")
    return per_split
