"""`python -m workbench.plan.calibrate --cluster NAME (--csv MEASURED.csv | --mlflow-uri URI
[--experiment NAME]) [--fit a,b] [--dry-run]`

Fits a few named coefficients of one cluster to measurements (rows in the published_layouts
schema whose GPU matches the cluster's, or MLflow runs that logged `pred/step_time_s` beside
measured `step_time_s`, see calibrate_mlflow) and writes them into conf/cluster/NAME.yaml under
`coeff:`, keeping the file's comments. Only coefficients change, never formulas; each is kept
inside a physically plausible range, so a fit cannot buy accuracy with nonsense.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from workbench.cli import ArgParser, guarded
from workbench.compose import typed
from workbench.config import CONF_DIR, ClusterConfig
from workbench.errors import ConfigError, InputError
from workbench.plan.coefficients import NAMES, Coefficients, coefficients
from workbench.plan.hardware import match_gpu
from workbench.plan.validate import Case, predict_case, read_rows, row_case

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


def main(argv: list[str]) -> int:
    p = ArgParser(prog="python -m workbench.plan.calibrate",
                description="Fit a cluster's cost-model coefficients to measurements.")
    p.add_argument("--cluster", required=True, help="conf/cluster/NAME.yaml to calibrate")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", type=Path, help="measured rows (published schema)")
    src.add_argument("--mlflow-uri", help="MLflow tracking URI of runs that logged "
                     "pred/step_time_s beside measured step_time_s")
    p.add_argument("--experiment", default=None, help="MLflow experiment (default: all)")
    p.add_argument("--fit", default=",".join(DEFAULT_FIT),
                   help=f"coefficients to fit (of {', '.join(BOUNDS)})")
    p.add_argument("--conf-dir", type=Path, default=CONF_DIR, help="config folder")
    p.add_argument("--dry-run", action="store_true", help="print, do not write the YAML")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.fit.split(",") if n.strip()]
    for n in names:
        if n not in BOUNDS:
            raise ConfigError("--fit", n, f"not a fittable coefficient; valid: "
                              f"{', '.join(BOUNDS)} (all coefficients: {', '.join(NAMES)})")
    path = args.conf_dir / "cluster" / f"{args.cluster}.yaml"
    if not path.is_file():
        valid = sorted(q.stem for q in (args.conf_dir / "cluster").glob("*.yaml"))
        raise ConfigError("--cluster", args.cluster, f"no such cluster; valid: {', '.join(valid)}")
    from workbench.compose import compose

    cluster = compose([f"cluster={args.cluster}"]).cluster if args.conf_dir == CONF_DIR else \
        _load_cluster(path)
    if args.mlflow_uri:
        from workbench.plan.calibrate_mlflow import load_mlflow_cases

        cases, skipped = load_mlflow_cases(args.mlflow_uri, args.experiment, cluster)
        if not cases:
            raise InputError(f"--mlflow-uri {args.mlflow_uri}: no run with pred/step_time_s "
                             f"and measured step_time_s on {cluster.gpu} ({len(skipped)} "
                             "skipped" + (f"; first: {skipped[-1]})" if skipped else ")"))
    else:
        _, rows = read_rows(args.csv)
        cases = load_cases(rows, cluster)
        if not cases:
            raise InputError(f"--csv {args.csv}: no usable rows for GPU {cluster.gpu}")
    start = coefficients(cluster)
    before = error_pct(cases, start)
    fitted = fit(cases, start, names)
    after = error_pct(cases, fitted)
    print(f"{args.cluster}: {len(cases)} measured {'runs' if args.mlflow_uri else 'rows'} on "
          f"{cluster.gpu}")
    print(f"median abs error before {before:.1f}% -> after {after:.1f}%")
    new = {**{k: float(v) for k, v in (cluster.coeff or {}).items()},
           **{n: getattr(fitted, n) for n in names}}
    for n in names:
        print(f"  {n}: {getattr(start, n):.4g} -> {getattr(fitted, n):.4g}")
    if not args.dry_run:
        write_coeff(path, new)
        print(f"wrote coeff: to {path}")
    return 0


def _load_cluster(path: Path) -> ClusterConfig:
    """A cluster YAML outside conf/ (tests use a temporary copy), typed by the schema."""
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.load(path)
    except Exception as e:
        raise InputError(f"{path}: cannot parse ({e})") from None
    raw.pop("defaults", None)
    return typed(ClusterConfig, raw, str(path))


if __name__ == "__main__":
    sys.exit(guarded(main)(sys.argv[1:]))
