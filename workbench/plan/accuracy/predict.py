"""Predictions for published runs: the rows' CSV in, the same rows with `pred_*` columns out.

A row that cannot be estimated (unknown GPU, missing degree) gets its reason in `pred_error`
instead of stopping the file: one bad row must not hide the others.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from workbench.errors import ConfigError, InputError
from workbench.plan.accuracy.published import REQUIRED, Case, row_case, row_stack
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.estimate import Estimate, estimate
from workbench.plan.cost.hardware import GIB

PRED_COLUMNS = ("pred_step_time_s", "pred_tokens_per_s_per_gpu", "pred_tflops_per_gpu",
                "pred_hw_tflops_per_gpu", "pred_mfu", "pred_peak_mem_gib", "pred_headroom_gib",
                "pred_fits", "pred_error")


def default_csv() -> Path:
    """benchmarks/calibration/published_layouts.csv of this checkout: the published rows live in
    the repository, so a clone alone runs every documented command."""
    return Path(__file__).resolve().parents[3] / "benchmarks" / "calibration" / \
        "published_layouts.csv"


def predict_case(case: Case, coeff: Coefficients | None = None) -> Estimate:
    co = coeff or coefficients(case.cluster)
    return estimate(case.model, case.cluster, case.train, case.layout, software=case.software,
                    coeff=co)


def predict_row(row: dict[str, str], coeff: dict[str, float] | None = None
                ) -> dict[str, str]:
    """The prediction columns for one row; never raises."""
    out = {k: "" for k in PRED_COLUMNS}
    try:
        case = row_case(row, coeff)
        est = predict_case(case)
    except (ValueError, KeyError, ConfigError, ZeroDivisionError) as e:
        out["pred_error"] = " ".join(str(e).strip("'\"").split())
        return out
    n = case.layout.world_size
    out.update({
        "pred_step_time_s": f"{est.step_time_s:.6g}",
        "pred_tokens_per_s_per_gpu": f"{est.tokens_per_s / n:.6g}",
        "pred_tflops_per_gpu": f"{est.model_flops_per_step / est.step_time_s / n / 1e12:.6g}",
        "pred_hw_tflops_per_gpu": f"{est.hw_flops_per_step / est.step_time_s / n / 1e12:.6g}",
        "pred_mfu": f"{est.mfu:.4f}", "pred_peak_mem_gib": f"{est.peak_mem_bytes / GIB:.4g}",
        "pred_headroom_gib": f"{est.headroom_bytes / GIB:.4g}",
        "pred_fits": "true" if est.fits else "false"})
    return out


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a CSV; InputError if it is missing or not a CSV of this schema."""
    if not path.is_file():
        raise InputError(f"--csv {path}: no such file")
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            header = list(reader.fieldnames or [])
    except (UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"--csv {path}: cannot parse as CSV ({e})") from None
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise InputError(f"--csv {path}: not in the published_layouts schema; missing columns "
                         f"{', '.join(missing)}")
    return header, rows


def check_stacks(rows: list[dict[str, str]], path: Path) -> None:
    """Refuse the file if any row names no or an unknown stack or sets a fact to a bad value:
    ConfigError naming the column, the row and what is valid. Unlike a row that cannot be
    estimated (its reason goes in pred_error), a wrong description would be scored as if it were
    right, so it stops the run before anything is written."""
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        row_stack(row, f" (line {i} of {path.name})")


def apply_facts(rows: list[dict[str, str]], facts: list[dict[str, str]]
                ) -> tuple[list[dict[str, str]], int]:
    """Rows with the fields a facts table (source_group, model, gpu_type, precision: the row
    key; column, value, evidence) fills in, and how many it filled. A fact fills only a field
    the row leaves empty: what a source printed is never overwritten by what was found about
    it elsewhere. A fact's column is any column of the schema, a stack fact column included
    (`norm_kernel`, `fsdp_fp8_gather`)."""
    filled, out = 0, []
    key = ("source_group", "model", "gpu_type", "precision")
    for row in rows:
        row = dict(row)
        for f in (f for f in facts if all(row.get(k) == f[k] for k in key)):
            if not (row.get(f["column"]) or "").strip():
                row[f["column"]] = f["value"]
                filled += 1
        out.append(row)
    return out, filled


def write_rows(path: Path, header: Sequence[str], rows: list[dict[str, str]]) -> None:
    """Write via a temporary file, so a failure never leaves half a CSV behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(header), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
