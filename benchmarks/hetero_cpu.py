"""The planner's uneven pipeline split over CPU pools, one of them emulated slow, against the even
split: measured step times and their ratio, the planner's stage times against measured ones, and
the losses against one process's.

    python benchmarks/hetero_cpu.py [--steps 8] [--layers 8] [--fast-cpus 1.0] [--quick]

Configured as a user's run would be: cluster=cpu_two_pools (workbench/conf/cluster) describes
two pools of one CPU rank each, the second stated 3x slower. The planner
(workbench.plan.pools.search.plan_pipeline, the per-pool costs and layer split of
workbench.plan.pools.pipeline) chooses the order of the pools along the pipeline and each
stage's layers; the engine runs that layout (pp 2, layout.stage_layers) on 2 gloo ranks,
pipeline rank r on the pool of stage r, and the even split the same way in the same process
group. The emulation is real and measurable: each pool's rank runs in a cgroup capped at its
pool's share of the CPU (workbench.testing.cpuquota), the slow pool's quota set from the
cluster's figures (its peak_fp32_flops over the fast pool's, times --fast-cpus). Step times are
medians over the steps after the first. Stage times are measured apart: each pool's process, in
its cgroup, times forward + backward of its stage on one micro-batch, both pools at once as in
the pipeline. Exit 1 when a loss differs from one process's by more than 1e-5 (relative), or,
without --quick, when the planner's split is not faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from workbench import layout as layouts
from workbench.compose import compose
from workbench.data.corpus import load as load_data
from workbench.layout import even_split
from workbench.plan.pools.cluster import pools_of
from workbench.plan.pools.search import PoolPipeline, plan_pipeline
from workbench.plan.search.rules import validate_layout
from workbench.testing.cpuquota import CpuQuota, unavailable_reason
from workbench.testing.multirank import (
    Case,
    max_rel_loss_err,
    median_after_first,
    run_cases,
    run_single,
)

PARITY_REL = 1e-5


def pool_cpus(cluster: Any, fast_cpus: float) -> Dict[str, float]:
    """Each pool's CPU quota: `fast_cpus` for the fastest, the others in proportion to their
    stated peak_fp32_flops (the cluster description sets the emulation)."""
    pools = pools_of(cluster)
    top = max(p.spec.peak_fp32_flops for p in pools)
    return {p.name: fast_cpus * p.spec.peak_fp32_flops / top for p in pools}


def choose(cfg: Any, micro_batch: int) -> tuple[PoolPipeline, PoolPipeline]:
    """The planner's best pipeline of one stage per pool (every order of the pools), and the
    even split over the same stages, both as the planner predicts them."""
    names = [p.name for p in pools_of(cfg.cluster)]
    plans = [plan_pipeline(cfg.model, cfg.cluster, cfg.train, list(order), micro_batch)
             for order in itertools.permutations(names)]
    best = min(plans, key=lambda p: p.step_time_s)
    even = plan_pipeline(cfg.model, cfg.cluster, cfg.train, list(best.pools), micro_batch,
                         list(even_split(cfg.model.n_layers, len(best.pools))))
    return best, even


def _time_stage(rank: int, cfg: Any, splits: Dict[str, List[int]], micro_batch: int,
                cgroups: List[str], out_dir: str, reps: int) -> None:
    """Child process `rank`: in its pool's cgroup, seconds of forward + backward of pipeline stage
    `rank` of every split on one micro-batch (median of `reps`, after 2 warm-up runs)."""
    from workbench.testing.cpuquota import join
    from workbench.train.model import build, cross_entropy
    from workbench.train.parallel.pipeline import split_stage

    join(cgroups[rank])
    torch.set_num_threads(1)
    m = cfg.model
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, m.vocab, (micro_batch, m.seq_len), generator=gen)
    hidden = torch.randn(micro_batch, m.seq_len, m.hidden, generator=gen)
    out: Dict[str, float] = {}
    for name, split in splits.items():
        stage = split_stage(build(m, cfg.train.seed), rank, split)
        last = rank == len(split) - 1

        def once(stage: torch.nn.Module = stage, last: bool = last) -> float:
            x = tokens if rank == 0 else hidden.clone().requires_grad_(True)
            t0 = time.perf_counter()
            y = stage(x)
            if last:
                cross_entropy(y, tokens).backward()
            else:
                y.backward(torch.ones_like(y))
            return time.perf_counter() - t0

        times = [once() for _ in range(reps + 2)][2:]
        out[name] = statistics.median(times)
    Path(out_dir, f"stage{rank}.json").write_text(json.dumps(out))


def measure_stages(cfg: Any, splits: Dict[str, List[int]], micro_batch: int,
                   cgroups: List[str], workdir: Path, reps: int) -> Dict[str, List[float]]:
    """{split name: measured seconds per micro-batch of each stage}."""
    import torch.multiprocessing as mp

    workdir.mkdir(parents=True, exist_ok=True)
    n = len(cgroups)
    mp.spawn(_time_stage, args=(cfg, splits, micro_batch, cgroups, str(workdir), reps),
             nprocs=n, join=True)
    per_rank = [json.loads(Path(workdir, f"stage{r}.json").read_text()) for r in range(n)]
    return {name: [per_rank[r][name] for r in range(n)] for name in splits}


def run_splits(base: List[str], splits: Dict[str, List[int]], cgroups: List[str], root: Path,
               data: Any) -> Dict[str, Dict[str, Any]]:
    """Each split trained on 2 gloo ranks in one spawned group (rank r in cgroups[r]), then
    {name: {step_time_s, max_rel_loss_err, ...}} against the single-process run."""
    cfg = compose(base)
    torch.set_num_threads(1)  # the ranks run one thread each: the same arithmetic
    single = run_single(cfg, layouts.resolve(cfg.layout, cfg.train, 1), data,
                        str(root / "single"))
    ref = [h["loss"] for h in single["history"]]
    cases = []
    for name, split in splits.items():
        c = compose(base + ["layout=pp", f"layout.pp={len(split)}",
                            f"layout.stage_layers=[{','.join(map(str, split))}]"])
        lay = layouts.resolve(c.layout, c.train, len(split))
        validate_layout(lay, c.model, len(split))
        cases.append(Case(name, c, lay, ""))
    results = run_cases(len(cgroups), cases, data, str(root / "ranks"), timeout_s=900,
                        cgroups=cgroups)
    out: Dict[str, Dict[str, Any]] = {}
    for case, res in zip(cases, results):
        if "error" in res:
            raise RuntimeError(f"{case.name}: {res['error']}\n{res.get('traceback', '')}")
        losses = [h["loss"] for h in res["history"]]
        err = max_rel_loss_err(res["history"], ref)
        out[case.name] = {"key": case.layout.key(), "losses": losses,
                          "step_time_s": median_after_first(res["history"], "step_time_s"),
                          "max_rel_loss_err": err, "steps": len(losses)}
    out["single"] = {"losses": ref}
    return out


def report(plan: PoolPipeline, even: PoolPipeline, cpus: Dict[str, float],
           runs: Dict[str, Dict[str, Any]], stages: Dict[str, List[float]]) -> Dict[str, Any]:
    """Print the comparison; the figures as one dict (--json)."""
    rows = {"planner": plan, "even": even}
    print("pools in pipeline order: "
          + ", ".join(f"{p} (quota {cpus[p]:.2f} CPU)" for p in plan.pools))
    print(f"{'split':<9}{'layers':<10}{'step_s pred':>12}{'step_s meas':>12}"
          f"{'loss rel err':>14}  stage s/micro-batch pred -> meas")
    for name, p in rows.items():
        r = runs[name]
        st = "  ".join(f"{pool}:{a:.4f}->{b:.4f}" for pool, a, b in
                       zip(p.pools, p.stage_s, stages[name]))
        print(f"{name:<9}{'-'.join(map(str, p.layers)):<10}{p.step_time_s:>12.4f}"
              f"{r['step_time_s']:>12.4f}{r['max_rel_loss_err']:>14.1e}  {st}")
    speed = runs["even"]["step_time_s"] / runs["planner"]["step_time_s"]
    pred = even.step_time_s / plan.step_time_s
    print(f"planner's split vs even: {speed:.2f}x faster measured, {pred:.2f}x predicted")
    for name, p in rows.items():
        ratio = [b / a for a, b in zip(p.stage_s, stages[name])]
        print(f"  {name}: measured / predicted stage time: "
              + ", ".join(f"{pool} {x:.2f}" for pool, x in zip(p.pools, ratio)))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    return {"pools": list(plan.pools), "quota_cpus": cpus, "speedup_measured": speed,
            "speedup_predicted": pred, "load_avg": list(load),
            **{name: {"layers": list(p.layers), "pred_stage_s": list(p.stage_s),
                      "meas_stage_s": stages[name], "pred_step_s": p.step_time_s,
                      **{k: v for k, v in runs[name].items() if k != "losses"}}
               for name, p in rows.items()}}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8, help="model.n_layers of gpt_tiny")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--fast-cpus", type=float, default=1.0, help="the fast pool's CPU quota")
    ap.add_argument("--quick", action="store_true", help="3 steps, 4 layers (the README test)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    why = unavailable_reason()
    if why:
        print(f"hetero_cpu: CPU quotas unavailable: {why}", file=sys.stderr)
        return 2
    steps, n_layers = (3, 4) if args.quick else (args.steps, args.layers)
    base = ["model=gpt_tiny", f"model.n_layers={n_layers}", "cluster=cpu_two_pools",
            f"train.steps={steps}", f"train.global_batch={args.global_batch}",
            f"train.micro_batch={args.micro_batch}", "train.eval_every=100000",
            "train.ckpt_every=100000", "tracking=none", "data.max_bytes=1000000"]
    cfg = compose(base)
    plan, even = choose(cfg, args.micro_batch)
    cpus = pool_cpus(cfg.cluster, args.fast_cpus)
    splits = {"planner": list(plan.layers), "even": list(even.layers)}
    print(f"gpt_tiny with {n_layers} layers on cluster {cfg.cluster.name}, global batch "
          f"{args.global_batch} in {plan.micro_batches} micro-batches of {args.micro_batch}, "
          f"{steps} steps, pp {len(plan.pools)} (1F1B) on gloo")
    root = Path(tempfile.mkdtemp(prefix="wb-hetero-cpu-"))
    quotas = [CpuQuota(f"{i}-{p}", cpus[p]) for i, p in enumerate(plan.pools)]
    for q in quotas:
        q.__enter__()
    try:
        groups = [q.path for q in quotas]
        runs = run_splits(base, splits, groups, root, load_data(cfg.data))
        stages = measure_stages(cfg, splits, args.micro_batch, groups, root / "stages",
                                reps=3 if args.quick else 7)
    finally:
        for q in quotas:
            q.__exit__(None, None, None)
    out = report(plan, even, cpus, runs, stages)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = [n for n in splits if runs[n]["max_rel_loss_err"] > PARITY_REL]
    if bad:
        print(f"FAIL: losses of {bad} differ from one process's by more than {PARITY_REL}")
        return 1
    print(f"losses equal one process's (within {PARITY_REL} relative): yes")
    if out["speedup_measured"] <= 1.0:
        print("the planner's split was NOT faster here" + (" (--quick: not checked)"
                                                           if args.quick else ""))
        return 0 if args.quick else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
