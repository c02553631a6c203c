"""Which of the cost model's own time terms a source's misses sit in (a diagnostic, not a fit).

For the measured rows of one source group, solve measured step time = sum over terms of
factor_term x predicted term (least squares, each row weighted by 1 / measured, so every row
counts by its relative error) and print each term's factor, the median error before and after,
and the same split per node count. A factor near 1 says the term is right as modelled; the
model's coefficients never see these factors.

    python benchmarks/term_split.py --csv benchmarks/calibration/hagemann2023_layouts.csv \
        --source hagemann2023 [--exclude 'torch attention'] [--exclude 'fused softmax'] \
        [--by tp]

With --by tp the groups are the TP degrees: a term whose factor holds across TP (the in-step
data-parallel sync of hagemann2023, x6-9 at TP 1, 2 and 4) is not a per-GPU link share that the
model splits wrong by TP (its NIC rails: 8 / TP per data-parallel group on a node).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from workbench.cli import guarded
from workbench.plan.accuracy.predict import predict_case, read_rows
from workbench.plan.accuracy.published import row_case

# The model's step-time terms, grouped: the compute of a micro-batch's passes, then each kind
# of communication and the pipeline bubble.
GROUPS = {"compute": ("time_fwd_s", "time_bwd_s", "time_recompute_s", "time_optimizer_s",
                      "time_cp_comm_s"),
          "tp": ("time_tp_comm_s",), "p2p": ("time_pp_p2p_s",), "bubble": ("time_pp_bubble_s",),
          "dp": ("time_dp_comm_exposed_s",)}


def term_table(rows: list[dict[str, str]], by: str = "nodes"
               ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(terms per row in GROUPS order, measured seconds, each row's group: its node count, or
    its TP degree with by="tp") of the rows with a step time."""
    terms, meas, nodes = [], [], []
    for row in rows:
        if (row.get("outcome") or "").strip().lower() == "oom" or not row.get("value"):
            continue
        if row.get("metric") != "seconds_per_iter":
            continue
        case = row_case(row)
        est = predict_case(case)
        terms.append([sum(est.time_s[k] for k in keys) for keys in GROUPS.values()])
        meas.append(float(row["value"]))
        nodes.append(case.layout.tp if by == "tp" else case.cluster.nodes)
    return np.array(terms), np.array(meas), nodes


def factors(terms: np.ndarray, meas: np.ndarray) -> tuple[dict[str, float], float, float]:
    """(factor per term group, median error % before, after): the relative least squares."""
    w = 1.0 / meas
    used = terms.any(axis=0)  # a term no row has (dp on one node) cannot be split out
    coef, *_ = np.linalg.lstsq(terms[:, used] * w[:, None], meas * w, rcond=None)
    full = np.full(len(GROUPS), float("nan"))
    full[used] = coef
    before = 100 * statistics.median(abs(terms.sum(axis=1) / meas - 1))
    after = 100 * statistics.median(abs(terms[:, used] @ coef / meas - 1))
    return dict(zip(GROUPS, full.tolist())), before, after


def _line(label: str, n: int, f: dict[str, float], before: float, after: float) -> str:
    parts = " ".join(f"{k} x{v:.2f}" for k, v in f.items())
    return f"{label:<14} {n:>4} rows  {parts}  median error {before:.1f}% -> {after:.1f}%"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", action="append", required=True, type=Path)
    ap.add_argument("--source", required=True, help="source_group to split")
    ap.add_argument("--exclude", action="append", default=[],
                    help="leave out rows whose model name contains this text")
    ap.add_argument("--by", choices=("nodes", "tp"), default="nodes",
                    help="the groups split separately after all rows: node count or TP degree")
    args = ap.parse_args(argv)
    rows = [r for p in args.csv for r in read_rows(p)[1]
            if r.get("source_group") == args.source
            and not any(x in (r.get("model") or "") for x in args.exclude)]
    terms, meas, nodes = term_table(rows, args.by)
    if len(meas) < len(GROUPS):
        print(f"error: --source {args.source}: {len(meas)} rows with a step time; "
              f"need at least {len(GROUPS)}", file=sys.stderr)
        return 2
    print(_line("all", len(meas), *factors(terms, meas)))
    groups = defaultdict(list)
    for i, n in enumerate(nodes):
        groups[n].append(i)
    for n, idx in sorted(groups.items()):
        if len(idx) >= 2 * len(GROUPS):
            label = f"tp {n}" if args.by == "tp" else f"{n} nodes"
            print(_line(label, len(idx), *factors(terms[idx], meas[idx])))
    return 0


if __name__ == "__main__":
    raise SystemExit(guarded(main)(sys.argv[1:]))
