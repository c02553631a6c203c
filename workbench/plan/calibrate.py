"""`python -m workbench.plan.calibrate --cluster NAME (--csv MEASURED.csv | --mlflow-uri URI
[--experiment NAME]) [--fit a,b] [--dry-run]`

Fits a few named coefficients of one cluster to measurements (rows in the published_layouts
schema whose GPU matches the cluster's, or MLflow runs that logged `pred/step_time_s` beside
measured `step_time_s`: workbench.plan.accuracy.mlflow_runs) and writes them into
conf/cluster/NAME.yaml under `coeff:`, keeping the file's comments (workbench.plan.accuracy.fit
says how).
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from workbench.cli import ArgParser, guarded
from workbench.compose import compose, typed
from workbench.config import CONF_DIR, ClusterConfig
from workbench.errors import ConfigError, InputError
from workbench.plan.accuracy.fit import (
    BOUNDS,
    DEFAULT_FIT,
    error_pct,
    fit,
    load_cases,
    write_coeff,
)
from workbench.plan.accuracy.mlflow_runs import load_mlflow_cases
from workbench.plan.accuracy.predict import check_stacks, read_rows
from workbench.plan.cost.coefficients import NAMES, coefficients


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
    cluster = compose([f"cluster={args.cluster}"]).cluster if args.conf_dir == CONF_DIR else \
        _load_cluster(path)
    if args.mlflow_uri:
        cases, skipped = load_mlflow_cases(args.mlflow_uri, args.experiment, cluster)
        if not cases:
            raise InputError(f"--mlflow-uri {args.mlflow_uri}: no run with pred/step_time_s "
                             f"and measured step_time_s on {cluster.gpu} ({len(skipped)} "
                             "skipped" + (f"; first: {skipped[-1]})" if skipped else ")"))
    else:
        _, rows = read_rows(args.csv)
        check_stacks(rows, args.csv)  # a wrong stack is bad input, not a row to skip
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
    try:
        raw = OmegaConf.load(path)
    except Exception as e:
        raise InputError(f"{path}: cannot parse ({e})") from None
    raw.pop("defaults", None)
    return typed(ClusterConfig, raw, str(path))


if __name__ == "__main__":
    sys.exit(guarded(main)(sys.argv[1:]))
