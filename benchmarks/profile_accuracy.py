"""The planner on the machine in front of it: profile this machine, then predict and measure
layouts of 1, 2 and 4 gloo ranks (and 2 ranks over a rate-limited link), from the profile and
from datasheet figures alone, all in one run.

    python benchmarks/profile_accuracy.py [--steps 8] [--rate-mbit 100] [--quick] [--json F]

Every layout runs gpt_tiny through the real engine and loop (workbench.testing.multirank: a
fresh spawned gloo group every 8 layouts, one rank included; over the link each rank sits in
its own network namespace behind a `tc`-limited NIC, so it needs root). Measured: the median
step after the first, the median of three interleaved rounds.
Predicted: `estimate()` on the profiled cluster file (`cluster=bench_here`, `bench_link`) and
on `local_cpu` (the datasheet figures; over the link its NIC rate set to the link's). The
default run is also checked as a user runs it: `python -m workbench.run cluster=bench_here
train.steps=30`, its logged pred/step_time_s against its median step.

The machine's speed: the default run's layout (`single mb16`) is measured again before and
after each profile and after each set of rows. The verdict needs those marks within 10% of
each other. Beside the errors as priced, the report prints them as they would read at the
speed measured around each row (its price times the marks around its rows over the marks
around its profile): a diagnostic that tells the cost model's misses from the host's drift,
never the verdict, since its scale is read off the run.

Development and held-out rows: the 138 rows marked `dev` in profile_layouts.py are the ones the
cost model's measured terms were developed against (every choice in
workbench/plan/cost/engine_residuals.py, measured_terms.py, the pipeline's bubble and sends,
and workbench/profile/ was made looking at them): 17 from the start and eight sets that were
held out until their runs showed a miss (TP beside other ranks on shared cores: the busy probes;
pipelines of unlike stages and sends behind compute: the fill-and-drain bubble, overlapped
sends; DP composed with TP, CP or sharding: the composed probes; the level of every row: the
probes' reference block; 4-rank rows priced fast, and two profiles apart at 4 ranks: where the
ranks outnumber the cores, the others kept busy while rank 0 times; TP and CP with full
recomputation priced fast: their engine cost's forward share paid again by the recomputed
forward; nearly every row priced fast: the engine's optimizer step, probed as the loop runs it;
4-rank rows measured slow late in a run: the harness's fresh group every 8 layouts). The 16
`held-out` rows were defined, in the commit before their first run, after those choices were
fixed. Verdict (not in --quick, a smoke test at CI size that measures one
layout per world size): on the held-out rows, median error at most 10% and Spearman at least
0.9; the default run within 15%; the machine's speed steady within 10%. Exit 1 when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
from profile_layouts import LAYOUTS  # the rows, beside this file

from workbench import layout as layouts
from workbench.compose import compose
from workbench.data.corpus import load as load_data
from workbench.plan.cost.estimate import estimate
from workbench.plan.search.rules import validate_layout
from workbench.profile import clusterfile
from workbench.profile.job import launch_profile, profile_job, result
from workbench.profile.rank import threads_for
from workbench.profile.spec import spec_for
from workbench.testing import netns
from workbench.testing.multirank import Case, median_after_first, run_cases

REFERENCE = "single mb16"  # measured again between the sets: how steady the machine's speed was
SPEED_MOVED_MAX = 0.10  # a verdict needs the machine's speed steady within this
ROUNDS = 3  # each layout is measured this many times, interleaved; the median of their medians
CASES_PER_GROUP = 8  # layouts run in one group of ranks before the next starts afresh


def base_overrides(steps: int, world: int) -> List[str]:
    return ["model=gpt_tiny", f"train.steps={steps}", "train.global_batch=16",
            "train.eval_every=100000", "train.eval_batches=1", "train.ckpt_every=100000",
            "tracking=none", "data.max_bytes=1000000", f"train.threads={threads_for(world)}"]


def write_cluster(conf: Path, name: str, profile: Dict[str, Any]) -> None:
    base = compose(["cluster=local_cpu"]).cluster
    profile["measured"]["command"] = "benchmarks/profile_accuracy.py"
    clusterfile.write(conf / "cluster" / f"{name}.yaml",
                      clusterfile.cluster_dict(base, name, profile))


def profile_here(conf: Path, work: Path, quick: bool) -> None:
    """This machine's ranks over loopback, through torchrun as a run of 4 ranks starts."""
    cfg = compose(["cluster=local_cpu", "launcher=torchrun", "launcher.nproc_per_node=4"])
    spec = spec_for(cfg, [asdict(cfg.model)], ["fp32"], 4, 64 << 20, quick)
    write_cluster(conf, "bench_here", launch_profile(cfg, spec, work))


def profile_link(conf: Path, work: Path, link: netns.LimitedLink, quick: bool) -> None:
    """The same over the link: one rank per namespace, each a node of its own."""
    cfg = compose(["cluster=local_cpu"])
    spec = spec_for(cfg, [asdict(cfg.model)], ["fp32"], 4, 16 << 20, quick)
    job = profile_job(cfg, spec, work, world=link.n)
    netns.run_job_in_namespaces(link, str(job.path))
    write_cluster(conf, "bench_link", result(work))


def measure(world: Any, rows: List[Dict[str, Any]], steps: int, root: Path,
            link: Optional[netns.LimitedLink], rounds: int = ROUNDS) -> None:
    """Run the rows of one world size (or the link) and record their median step."""
    n = 2 if world == "link" else int(world)
    cases = []
    for row in rows:
        cfg = compose(base_overrides(steps, n) + row["overrides"])
        layout = layouts.resolve(cfg.layout, cfg.train, n)
        validate_layout(layout, cfg.model, n)
        row.update(cfg=cfg, layout=layout)
        cases.append(Case(row["name"], cfg, layout, ""))
    data = load_data(cases[0].cfg.data)
    every = cases * rounds  # every layout once, then again: a slow spell falls on several
    # a fresh group of ranks every few cases, as a run has its own processes: what a case
    # leaves behind (gloo subgroups, cached models) slowed the 30th case of a group by 20-30%
    results = run_cases(n, every, data, str(root / f"w{world}"), timeout_s=3600,
                        netns=link.namespaces if link else None,
                        cases_per_group=CASES_PER_GROUP)
    for i, res in enumerate(results):
        if "error" in res:
            name = rows[i % len(rows)]["name"]
            raise RuntimeError(f"{name}: {res['error']}\n{res.get('traceback', '')}")
    for i, row in enumerate(rows):
        row["measured_s"] = statistics.median(
            median_after_first(results[i + r * len(rows)]["history"], "step_time_s")
            for r in range(rounds))


def speed_mark(marks: List[Dict[str, Any]], label: str, steps: int, root: Path) -> None:
    """The reference layout (one rank, the default run's shape) measured again now. The
    profile and the rows are measured tens of minutes apart; a slow spell of the machine (a
    shared host's neighbours) between them reads as a pricing error. At stop 42 the same
    layout measured 151.9 ms among the 1-rank rows and 123.5 ms half an hour later."""
    row = {"name": REFERENCE, "world": 1, "overrides": [], "split": "mark"}
    if not marks:  # the run's first measurement read slow (a quick run's: 177 vs 142 ms)
        measure(1, [row], steps, root / "mark-warm-up", None, 1)
    measure(1, [row], steps, root / f"mark{len(marks)}", None, 1)
    marks.append({"when": label, "measured_s": row["measured_s"]})
    print(f"speed mark {label}: {REFERENCE} {row['measured_s'] * 1e3:.1f} ms",
          file=sys.stderr, flush=True)


def speed_moved(marks: List[Dict[str, Any]]) -> float:
    """How far the machine's speed moved during the run: the slowest mark over the fastest."""
    times = [m["measured_s"] for m in marks]
    return max(times) / min(times) - 1 if times else 0.0


def predict(row: Dict[str, Any], rate_mbit: float) -> None:
    cfg, layout, link = row["cfg"], row["layout"], row["world"] == "link"
    profiled = compose([f"cluster={'bench_link' if link else 'bench_here'}"]).cluster
    datasheet = compose(["cluster=local_cpu"] + ([
        "cluster.nodes=2", "cluster.gpus_per_node=1",
        f"cluster.inter_node_gbps={rate_mbit / 8000}"] if link else [])).cluster
    for key, cluster in (("profile_s", profiled), ("datasheet_s", datasheet)):
        row[key] = estimate(cfg.model, cluster, cfg.train, layout).step_time_s


def spearman(a: List[float], b: List[float]) -> float:
    def ranks(x: List[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def summary(rows: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    errors = [abs(r[key] / r["measured_s"] - 1) for r in rows]
    return {"median_abs_err": statistics.median(errors), "max_abs_err": max(errors),
            "spearman": spearman([r[key] for r in rows], [r["measured_s"] for r in rows])}


def default_run(conf: Path, work: Path) -> Dict[str, float]:
    """`python -m workbench.run cluster=bench_here train.steps=30` as a user types it."""
    env = {**os.environ, "WORKBENCH_CONF": str(conf),
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    subprocess.run([sys.executable, "-m", "workbench.run", "cluster=bench_here",
                    "train.steps=30"], cwd=work, env=env, check=True, capture_output=True)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])[0]
    steps = sorted(client.get_metric_history(run.info.run_id, "step_time_s"),
                   key=lambda m: m.step)
    measured = statistics.median(m.value for m in steps[1:])
    return {"pred_s": run.data.metrics["pred/step_time_s"], "measured_s": measured}


def splits(rows: List[Dict[str, Any]], with_all: bool) -> List[tuple]:
    """The parts the report scores (all rows, development, held out), those with two rows or
    more (a Spearman needs two)."""
    parts = [("all", rows)] if with_all else []
    parts += [("development", [r for r in rows if r["split"] == "dev"]),
              ("held-out", [r for r in rows if r["split"] != "dev"])]
    return [(label, part) for label, part in parts if len(part) >= 2]


def at_row_speed(rows: List[Dict[str, Any]], marks: List[Dict[str, Any]]) -> None:
    """Print the errors as they would read had the machine run the rows at the profile's speed:
    each price scaled by the reference layout's time around its rows over its time around its
    profile. A diagnostic that tells the cost model's misses from the host's drift, never the
    verdict: the scale is read off the run, and the issue asks for prices made before it."""
    def speed(at: List[int]) -> float:
        return statistics.mean(marks[i]["measured_s"] for i in at)

    rows = [r for r in rows if "speed_at" in r and max(r["speed_at"]) < len(marks)]
    for r in rows:
        r["at_row_speed_s"] = r["profile_s"] * speed(r["speed_at"]) / speed(r["profiled_at"])
    for label, part in splits(rows, with_all=False):
        p = summary(part, "at_row_speed_s")
        print(f"{label:<12} {len(part):>2} layouts at the speed measured beside them "
              f"(diagnostic): median error {p['median_abs_err']:.1%} (max "
              f"{p['max_abs_err']:.1%}), Spearman {p['spearman']:.3f}")


def report(rows: List[Dict[str, Any]], default: Dict[str, float], quick: bool,
           marks: List[Dict[str, Any]]) -> bool:
    print(f"{'layout':<26}{'ranks':>6}{'split':>10}{'measured':>11}{'profile':>10}{'err':>8}"
          f"{'datasheet':>11}{'err':>8}")
    for r in rows:
        m = r["measured_s"]
        print(f"{r['name']:<26}{str(r['world']):>6}{r['split']:>10}{m * 1e3:>9.1f}ms"
              f"{r['profile_s'] * 1e3:>8.1f}ms{100 * (r['profile_s'] / m - 1):>+7.1f}%"
              f"{r['datasheet_s'] * 1e3:>9.1f}ms{100 * (r['datasheet_s'] / m - 1):>+7.1f}%")
    print()
    for label, part in splits(rows, with_all=True):
        p, d = summary(part, "profile_s"), summary(part, "datasheet_s")
        print(f"{label:<12} {len(part):>2} layouts: profile median error "
              f"{p['median_abs_err']:.1%} (max {p['max_abs_err']:.1%}), Spearman "
              f"{p['spearman']:.3f}; datasheet median error {d['median_abs_err']:.1%} "
              f"(max {d['max_abs_err']:.1%}), Spearman {d['spearman']:.3f}; ratio of median "
              f"errors {p['median_abs_err'] / max(d['median_abs_err'], 1e-9):.2f}")
    err = default["pred_s"] / default["measured_s"] - 1
    print(f"default run on cluster=bench_here: pred/step_time_s {default['pred_s'] * 1e3:.1f} "
          f"ms, measured median step {default['measured_s'] * 1e3:.1f} ms ({err:+.1%})")
    moved = speed_moved(marks)
    if marks:
        print(f"the machine's speed ({REFERENCE}, measured again): " + ", ".join(
            f"{m['measured_s'] * 1e3:.1f} ms {m['when']}" for m in marks)
            + f"; moved {moved:.1%} (at most {SPEED_MOVED_MAX:.0%} for a verdict)")
        at_row_speed(rows, marks)
    if quick:
        print("(--quick: a smoke test at CI size, no verdict)")
        return True
    held = [r for r in rows if r["split"] != "dev"]
    scored = summary(held, "profile_s")
    ok = scored["median_abs_err"] <= 0.10 and scored["spearman"] >= 0.9 and abs(err) <= 0.15
    steady = moved <= SPEED_MOVED_MAX
    print(f"verdict: {'PASS' if ok and steady else 'FAIL'} (median error <= 10%, Spearman >= "
          f"0.9 over the {len(held)} held-out layouts; the default run within 15%; the "
          f"machine's speed steady within {SPEED_MOVED_MAX:.0%}"
          + ("" if steady else ": it was not, so the errors mix two machines") + ")")
    return ok and steady


def between(rows: List[Dict[str, Any]], marks: List[Dict[str, Any]],
            profiled_at: List[int]) -> None:
    """Record, on rows just measured, the marks around their profile and around themselves:
    the last mark before them and the next one, taken right after this call."""
    for row in rows:
        row.update(profiled_at=profiled_at, speed_at=[len(marks) - 1, len(marks)])


def profile_and_measure(rows: List[Dict[str, Any]], conf: Path, root: Path, steps: int,
                        args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Profile, then measure every set of rows, with the reference layout measured before and
    after each: each row keeps which marks surround its profile (`profiled_at`) and its own
    measurement (`speed_at`), so the report can say how far the speed moved in between."""
    marks: List[Dict[str, Any]] = []
    rounds = 1 if args.quick else ROUNDS
    speed_mark(marks, "before the profile", steps, root)
    (root / "here").mkdir()
    print("profiling this machine (4 ranks over loopback) ...", file=sys.stderr, flush=True)
    profile_here(conf, root / "here", args.quick)
    speed_mark(marks, "after the profile", steps, root)
    for world in (1, 2, 4):
        print(f"measuring the layouts of {world} rank(s) ...", file=sys.stderr, flush=True)
        part = [r for r in rows if r["world"] == world]
        measure(world, part, steps, root, None, rounds)
        between(part, marks, profiled_at=[0, 1])
        speed_mark(marks, f"after the {world}-rank rows", steps, root)
    with netns.LimitedLink(2, args.rate_mbit) as link:
        print(f"profiling and measuring over a {args.rate_mbit:g} Mbit/s link ...",
              file=sys.stderr, flush=True)
        (root / "link").mkdir()
        profile_link(conf, root / "link", link, args.quick)
        speed_mark(marks, "after the link's profile", steps, root)
        part = [r for r in rows if r["world"] == "link"]
        measure("link", part, steps, root, link, rounds)
    between(part, marks, profiled_at=[len(marks) - 2, len(marks) - 1])
    speed_mark(marks, "after the link's rows", steps, root)
    return marks


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--quick", action="store_true", help="quick profiles, 3 steps, no verdict")
    ap.add_argument("--json", default="")
    ap.add_argument("--reuse", default="", metavar="DIR",
                    help="predict again from an earlier run's folder (its profiles and "
                         "measurements), measuring nothing")
    args = ap.parse_args(argv)
    if args.reuse:
        return reuse(Path(args.reuse), args)
    reason = netns.unavailable_reason()
    if reason:
        print(f"error: the rate-limited link {reason}", file=sys.stderr)
        return 2
    steps = 3 if args.quick else args.steps
    root = Path(tempfile.mkdtemp(prefix="wb-profile-accuracy-"))
    conf = root / "conf"
    os.environ["WORKBENCH_CONF"] = str(conf)
    rows = [{"name": n, "world": w, "overrides": o, "split": s} for n, w, o, s in LAYOUTS]
    if args.quick:  # a smoke test: one layout of each world size
        rows = [next(r for r in rows if r["world"] == w) for w in (1, 2, 4, "link")]
    marks = profile_and_measure(rows, conf, root, steps, args)
    for row in rows:
        predict(row, args.rate_mbit)
    (root / "default").mkdir()
    default = default_run(conf, root / "default")
    keep = ("name", "world", "split", "overrides", "measured_s", "profiled_at", "speed_at")
    (root / "measured.json").write_text(json.dumps(
        {"rows": [{k: r[k] for k in keep} for r in rows], "default_run": default,
         "rate_mbit": args.rate_mbit, "steps": steps, "quick": args.quick,
         "speed_marks": marks}))
    print(f"profiles and measurements kept in {root} (--reuse {root})", file=sys.stderr)
    return finish(rows, default, args, marks)


def reuse(root: Path, args: argparse.Namespace) -> int:
    """Predict again from an earlier run's folder: its cluster files and measured steps."""
    os.environ["WORKBENCH_CONF"] = str(root / "conf")
    data = json.loads((root / "measured.json").read_text())
    rows = data["rows"]
    held_out = any(row["split"] == "held-out" for row in rows)
    args.quick = args.quick or data.get("quick", not held_out)  # a smoke test holds no verdict
    for row in rows:
        n = 2 if row["world"] == "link" else int(row["world"])
        cfg = compose(base_overrides(data["steps"], n) + row["overrides"])
        row.update(cfg=cfg, layout=layouts.resolve(cfg.layout, cfg.train, n))
        predict(row, data["rate_mbit"])
    default = data["default_run"]
    default["pred_s"] = estimate(*_default_inputs()).step_time_s
    return finish(rows, default, args, data.get("speed_marks", []))


def _default_inputs() -> tuple:
    cfg = compose(["cluster=bench_here"])
    return cfg.model, cfg.cluster, cfg.train, layouts.resolve(cfg.layout, cfg.train, 1)


def finish(rows: List[Dict[str, Any]], default: Dict[str, float],
           args: argparse.Namespace, marks: List[Dict[str, Any]]) -> int:
    ok = report(rows, default, args.quick, marks)
    if args.json:
        keep = ("name", "world", "split", "measured_s", "profile_s", "datasheet_s")
        Path(args.json).write_text(json.dumps({"rows": [{k: r[k] for k in keep} for r in rows],
                                               "default_run": default,
                                               "speed_marks": marks}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
