"""Fitting a cluster's cost-model coefficients to measured runs.

Only coefficients change, never formulas; each is kept inside a physically plausible range
(BOUNDS), so a fit cannot buy accuracy with nonsense. The measured cases come from rows in the
published_layouts schema (load_cases) or from MLflow runs (workbench.plan.accuracy.mlflow_runs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from workbench.config import ClusterConfig
from workbench.errors import ConfigError
from workbench.plan.accuracy.predict import predict_case
from workbench.plan.accuracy.published import Case, row_case
from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.hardware import match_gpu

# Physically plausible ranges of the coefficients a fit may move.
BOUNDS: dict[str, tuple[float, float]] = {
    "mm_eff_max": (0.3, 0.95), "flash_eff": (0.2, 0.9), "elem_traffic": (1.0, 6.0),
    "link_eff_intra": (0.4, 0.95), "link_eff_inter": (0.4, 0.95), "dp_overlap": (0.0, 1.0),
    "tp_overlap": (0.0, 1.0), "async_tp_overlap": (0.0, 1.0), "kernel_overhead_s": (5e-6, 200e-6),
    "fp8_mm_speedup": (1.0, 2.0), "fp8_te_mm_speedup": (1.0, 2.0),
    "cp_overlap": (0.0, 1.0), "compile_elem_factor": (0.2, 1.0),
}
DEFAULT_FIT = ("mm_eff_max", "link_eff_inter", "dp_overlap")
MEASURED = {"tflops_per_gpu": "hw_tflops", "MFU_pct": "mfu",
            "tokens_per_sec_per_gpu": "tokens", "seconds_per_iter": "step"}


def _predicted(case: Case, co: Coefficients, metric: str) -> float:
    est = predict_case(case, co)
    n = case.layout.world_size
    kind = MEASURED[metric]
    if kind == "hw_tflops":
        return est.hw_flops_per_step / est.step_time_s / n / 1e12
    if kind == "mfu":
        return est.mfu * 100
    if kind == "tokens":
        return est.tokens_per_s / n
    return est.step_time_s


def load_cases(rows: list[dict[str, str]], cluster: ClusterConfig) -> list[tuple[Case, str, float]]:
    """Rows of this cluster's GPU with a usable measured figure, as typed cases."""
    want = match_gpu(cluster.gpu).name
    out = []
    for row in rows:
        try:
            if match_gpu(row.get("gpu_type", "")).name != want:
                continue
            if row.get("metric") not in MEASURED or not row.get("value"):
                continue
            out.append((row_case(row), row["metric"], float(row["value"])))
        except (ValueError, KeyError, ConfigError):
            continue
    return out


def error_pct(cases: Sequence[tuple[Case, str, float]], co: Coefficients) -> float:
    """Median absolute percentage error of the predicted measured figure."""
    errs = [abs(_predicted(c, co, m) - v) / v * 100 for c, m, v in cases]
    return statistics.median(errs) if errs else float("nan")


def _loss(cases, co: Coefficients) -> float:
    return sum(math.log(_predicted(c, co, m) / v) ** 2 for c, m, v in cases)


def fit(cases: Sequence[tuple[Case, str, float]], start: Coefficients, names: Sequence[str],
        rounds: int = 3, grid: int = 15) -> Coefficients:
    """Coordinate search in log space within BOUNDS: few parameters, robust, dependency-free."""
    co = start
    for _ in range(rounds):
        for name in names:
            lo, hi = BOUNDS[name]
            best = (_loss(cases, co), getattr(co, name))
            for k in range(grid):
                x = lo + (hi - lo) * k / (grid - 1)
                trial = replace(co, **{name: x})
                loss = _loss(cases, trial)
                if loss < best[0]:
                    best = (loss, x)
            step = (hi - lo) / (grid - 1)
            for _ in range(3):  # refine around the best grid point
                for x in (best[1] - step / 2, best[1] + step / 2):
                    if lo <= x <= hi:
                        loss = _loss(cases, replace(co, **{name: x}))
                        if loss < best[0]:
                            best = (loss, x)
                step /= 2
            co = replace(co, **{name: best[1]})
    return co


def write_coeff(path: Path, values: dict[str, float]) -> None:
    """Replace (or add) the `coeff:` mapping of a cluster YAML, keeping every comment line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    skip = False
    for line in lines:
        if line.startswith("coeff:"):
            skip = True
            continue
        if skip and (line.startswith("  ") or not line.strip()):
            continue
        skip = False
        out.append(line)
    out.append("coeff:  # fitted by python -m workbench.plan.calibrate")
    out += [f"  {k}: {v:.6g}" for k, v in sorted(values.items())]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
    tmp.replace(path)
