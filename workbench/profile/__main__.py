"""`python -m workbench.profile [OVERRIDES] --name NAME`: measure the cluster in front of you and
write it as a cluster file (`conf/cluster/NAME.yaml`) the planner and `cluster=NAME` use.

The overrides compose as a run's do: `cluster=` the base cluster (its datasheet figures are kept
beside the measurements), `model=` the model whose shapes are timed (`--models` adds more),
`launcher=` how the ranks start (local, torchrun, slurm), exactly as training starts them, so the
collectives are timed over the links and ranks a run will use.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import List

from workbench.cli import ArgParser, guarded
from workbench.compose import compose
from workbench.config import RunConfig, compute_dtype
from workbench.errors import ConfigError
from workbench.places import user_conf_dir
from workbench.profile import clusterfile
from workbench.profile.job import launch_profile
from workbench.profile.spec import ProfileSpec, spec_for


def _parser() -> ArgParser:
    p = ArgParser(prog="python -m workbench.profile", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config overrides (cluster=, model=, launcher=)")
    p.add_argument("--name", required=True, help="the cluster file's name: conf/cluster/NAME.yaml")
    p.add_argument("--models", default="", help="more models to time, comma-separated")
    p.add_argument("--dtypes", default="", help="compute dtypes to time (default: the run's)")
    p.add_argument("--max-tp", type=int, default=0,
                   help="largest tensor-parallel degree whose shapes are timed (default 4 on "
                        "a CPU, 8 on GPUs)")
    p.add_argument("--max-comm-mib", type=float, default=64.0,
                   help="largest collective payload timed (MiB)")
    p.add_argument("--force", action="store_true", help="replace an existing cluster file")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes, shorter trials: a smoke test, not a profile to plan on")
    return p


def _models(cfg: RunConfig, extra: str) -> List[dict]:
    out = [asdict(cfg.model)]
    for name in filter(None, (m.strip() for m in extra.split(","))):
        model = compose([f"model={name}"]).model
        if model.name not in {m["name"] for m in out}:
            out.append(asdict(model))
    return out


def _target(name: str, force: bool) -> Path:
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ConfigError("--name", name, "letters, digits, '_' and '-' only")
    path = user_conf_dir() / "cluster" / f"{name}.yaml"
    if path.exists() and not force:
        raise ConfigError("--name", name, f"{path} exists; --force replaces it")
    return path


@guarded
def main(argv: List[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    cfg = compose(args.overrides)
    path = _target(args.name, args.force)
    if args.max_tp < 0 or args.max_comm_mib <= 0:
        raise ConfigError("--max-tp" if args.max_tp < 0 else "--max-comm-mib",
                          args.max_tp if args.max_tp < 0 else args.max_comm_mib, "must be > 0")
    dtypes = [d for d in args.dtypes.split(",") if d] or [compute_dtype(cfg.train, cfg.cluster)]
    spec: ProfileSpec = spec_for(cfg, _models(cfg, args.models), dtypes, args.max_tp,
                                 int(args.max_comm_mib * 2**20), args.quick)
    work = Path(tempfile.mkdtemp(prefix="wb-profile-"))
    t0 = time.perf_counter()
    try:
        profile = launch_profile(cfg, spec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    profile["measured"]["command"] = "python -m workbench.profile " + " ".join(argv)
    clusterfile.write(path, clusterfile.cluster_dict(cfg.cluster, args.name, profile))
    print(clusterfile.summary(profile))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s; use it as cluster={args.name}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
