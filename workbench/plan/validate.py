"""`python -m workbench.plan.validate --csv IN --out OUT`: predict published training runs.

Reads rows in the schema of benchmarks/calibration/published_layouts.csv (each row's `stack` and
typed stack facts; docs/planner.md "Stack facts") and writes every input column plus the
predictions. An unknown stack or a bad fact value stops the run: one line, exit 2. A row that
cannot be estimated (unknown GPU, missing degree) gets its reason in `pred_error` instead of
stopping the file: one bad row must not hide the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workbench.cli import ArgParser, guarded
from workbench.plan.accuracy.predict import (
    PRED_COLUMNS,
    check_stacks,
    default_csv,
    predict_row,
    read_rows,
    write_rows,
)


def main(argv: list[str]) -> int:
    p = ArgParser(prog="python -m workbench.plan.validate",
                description="Predict every row of a published-layouts CSV.")
    p.add_argument("--csv", type=Path, default=None,
                   help="input rows (default: benchmarks/calibration/published_layouts.csv)")
    p.add_argument("--out", type=Path, required=True, help="output CSV")
    args = p.parse_args(argv)
    path = args.csv or default_csv()
    header, rows = read_rows(path)
    check_stacks(rows, path)
    out_rows = [{**row, **predict_row(row)} for row in rows]
    cols = header + [c for c in PRED_COLUMNS if c not in header]
    write_rows(args.out, cols, out_rows)
    bad = sum(1 for r in out_rows if r["pred_error"])
    print(f"wrote {len(out_rows)} rows to {args.out} ({bad} could not be estimated)")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main)(sys.argv[1:]))
