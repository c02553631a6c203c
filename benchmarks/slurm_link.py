"""ddp across two Slurm nodes over a rate-limited link: the measured step beside the cost model's
prediction for that link, from a profile of the link and from datasheet figures.

    python benchmarks/slurm_link.py [--rate-mbit 100] [--steps 12] [--quick]

Needs the two-node local cluster (`bash slurm/start-local-cluster.sh --nodes 2`, as root: the
rate is set with tc). In order, all through Slurm as a user would:
1. every node's NIC is set to --rate-mbit both ways (`slurm/nodes.sh up 2 RATE`); the cluster's
   own rate is put back at the end;
2. the two nodes are profiled (`python -m workbench.profile launcher=slurm launcher.nodes=2
   launcher.tasks_per_node=1 --name two_nodes`): the collectives across the link as curves;
3. ddp runs over the two nodes (`python -m workbench.run cluster=two_nodes launcher=slurm
   launcher.nodes=2 launcher.tasks_per_node=1 layout=ddp ...`): its logged pred/step_time_s
   (from the profile, made before the run) against its median step after the first;
4. the datasheet prediction of the same layout: local_cpu with two nodes whose inter-node link is
   the set rate.
It prints figures and ratios, no verdict. --quick: a quick profile and 3 steps (CI size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
NODES_SH = REPO / "slurm" / "nodes.sh"
SLURM_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/workbench-slurm"))
LAUNCH = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"]


def run_overrides(steps: int) -> List[str]:
    return ["model=gpt_tiny", "layout=ddp", f"train.steps={steps}", "train.global_batch=16",
            "train.micro_batch=8", "train.eval_every=100000", "train.eval_batches=1",
            "train.ckpt_every=100000", "data.max_bytes=1000000"]


def two_nodes_up() -> str:
    """'' when node1 and node2 are usable, else why not."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T"],
                         capture_output=True, text=True, timeout=30, check=False).stdout
    states = dict(line.split() for line in out.splitlines() if line.strip())
    ok = all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated")
             for n in ("node1", "node2"))
    return "" if ok else f"needs the two-node local cluster (bash slurm/start-local-cluster.sh " \
                         f"--nodes 2); sinfo: {states or 'no cluster'}"


def set_rate(mbit: float) -> None:
    subprocess.run(["bash", str(NODES_SH), "up", "2", f"{mbit:g}"], check=True, timeout=60,
                   capture_output=True)


def sh(cmd: List[str], work: Path, env: Dict[str, str]) -> None:
    t0 = time.time()
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    print(f"  done in {time.time() - t0:.0f} s", flush=True)


def measured_run(work: Path, env: Dict[str, str]) -> Dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])[0]
    steps = sorted(client.get_metric_history(run.info.run_id, "step_time_s"),
                   key=lambda m: m.step)
    return {"measured_s": statistics.median(m.value for m in steps[1:]),
            "pred_s": run.data.metrics["pred/step_time_s"],
            "nic": run.data.tags.get("wb.link.nic", ""),
            "nodes": f"{run.data.tags.get('wb.rank0.node')},{run.data.tags.get('wb.rank1.node')}"}


def datasheet_s(steps: int, rate_mbit: float) -> float:
    from workbench import layout as layouts
    from workbench.compose import compose
    from workbench.plan.cost.estimate import estimate

    cfg = compose(run_overrides(steps) + ["cluster=local_cpu", "cluster.nodes=2",
                                          "cluster.gpus_per_node=1",
                                          f"cluster.inter_node_gbps={rate_mbit / 8000}"])
    layout = layouts.resolve(cfg.layout, cfg.train, 2)
    return estimate(cfg.model, cfg.cluster, cfg.train, layout).step_time_s


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="quick profile, 3 steps: CI size")
    args = ap.parse_args(argv)
    why = two_nodes_up()
    if why:
        print(f"slurm_link: {why}", file=sys.stderr)
        return 2
    steps = 3 if args.quick else args.steps
    own = SLURM_DIR / "etc" / "link_mbit"
    before = float(own.read_text()) if own.is_file() else 0.0
    work = Path(tempfile.mkdtemp(prefix="wb-slurm-link-", dir=os.getcwd()))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    env.pop("WORKBENCH_CONF", None)  # the profile lands in work/conf, the run reads it there
    set_rate(args.rate_mbit)
    try:
        sh([sys.executable, "-m", "workbench.profile", *LAUNCH, "--name", "two_nodes",
            "--max-comm-mib", "16", *(["--quick"] if args.quick else [])], work, env)
        sh([sys.executable, "-m", "workbench.run", "cluster=two_nodes", *LAUNCH,
            *run_overrides(steps)], work, env)
    finally:
        set_rate(before)
    got = measured_run(work, env)
    sheet = datasheet_s(steps, args.rate_mbit)
    m = got["measured_s"]
    print(f"\nddp, gpt_tiny, 2 nodes ({got['nodes']}), one rank each, NIC {got['nic']} "
          f"(set: {args.rate_mbit:g} Mbit/s):")
    print(f"  measured median step      {m * 1e3:8.1f} ms")
    print(f"  profile of the link       {got['pred_s'] * 1e3:8.1f} ms  predicted/measured "
          f"{got['pred_s'] / m:.2f}")
    print(f"  datasheet, link at rate   {sheet * 1e3:8.1f} ms  predicted/measured {sheet / m:.2f}")
    if args.quick:
        print("(--quick: a smoke test at CI size; the profile is not one to plan on)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
