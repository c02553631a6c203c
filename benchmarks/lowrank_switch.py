"""The adaptive switch on real CPU runs: it fires by itself (below the max_switch_frac cap), at a
point that moves with the learning-rate schedule, and not with how often it checks.

Trains gpt_tiny (0.8M parameters, single process, one thread per run, two runs at a time) with
`lowrank=adaptive` in two LR schedules that differ only in their warm-up, each checked every
10 and every 40 steps. A run stops one step after its switch: the switch point is what is
measured, and the schedule is set by train.steps whether or not the run goes on. Prints every
run's switch (step, % of training, forced or not), each layer's signals at the switch and when
it latched, and checks:

- no switch was forced by max_switch_frac;
- check_every 10 and 40 switch within 2% of training of each other, in both settings;
- the two settings switch at least 5% of training apart.

    python benchmarks/lowrank_switch.py [--steps 2000] [--jobs 2] [--out DIR] [--smoke]
                                        [overrides...]

Exit 1 when a check fails. `--smoke` (the README test, a few steps: every switch is then forced
by the cap) runs the same code and prints no verdict.

Every run logs to MLflow (sqlite in DIR): the `lowrank/*` per-layer signals and the
`lowrank/signals.png` plot of each run are there to audit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

BASE = ["model=gpt_tiny", "lowrank=adaptive", "lowrank.max_switch_frac=0.9",
        "train.eval_every=100000", "train.ckpt_every=100000", "train.threads=1",
        "tracking.experiment=lowrank_switch"]
WARMUP_PCT = {"warmup5": 5, "warmup20": 20}  # the two LR schedules: % of training warming up
CHECKS = (10, 40)


def _run(args: tuple) -> dict[str, Any]:
    """One run, in its own process (spawned: a fresh torch per run), stopped after its switch
    unless a third item says to train on to the last step (lowrank_heldout.py's loss gap)."""
    run_dir, overrides, *rest = args
    to_the_end = bool(rest and rest[0])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from workbench.rank import run_job
    from workbench.submit import start

    _, job = start([*overrides, f"train.run_dir={run_dir}"])
    marker = Path(run_dir) / "rank_map.json"
    t0 = time.time()
    last = run_job(job, progress=False, stop_requested=None if to_the_end else marker.exists)
    out = json.loads(marker.read_text()) if marker.exists() else {}
    return {"run_dir": run_dir, "wall_s": time.time() - t0, "loss": last.get("loss"),
            "val_loss": last.get("val_loss"), "trainable": last.get("params/trainable"), **out}


def _print_run(name: str, r: dict[str, Any]) -> None:
    frac = 100.0 * r["switch_step"] / r["total_steps"]
    print(f"\n### {name}: switch at step {r['switch_step']} of {r['total_steps']} "
          f"({frac:.1f}%), {'FORCED by the cap' if r['forced'] else 'by the detector'}, "
          f"signal {r['signal']}, {r['wall_s']:.0f} s")
    print("| layer | full | rank at switch | energy rank W-W0 | overlap | rate /1% | latched % |")
    print("|---|---|---|---|---|---|---|")
    for n, s in r["signals"].items():
        layer = r["layers"].get(n, {})
        full = min(layer.get("out", 0), layer.get("in", 0)) or "-"
        rate = "-" if s["rate"] is None else f"{s['rate']:.3f}"
        lat = "open" if s["latched_pct"] is None else f"{s['latched_pct']:.1f}"
        print(f"| {n} | {full} | {s['rank']:.0f} | {s['energy_rank']:.0f} | "
              f"{s['overlap']:.3f} | {rate} | {lat} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true",
                    help="a smoke test at CI size: the runs and tables, no verdict")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    out = Path(a.out or f"bench-lowrank-switch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    runs: dict[str, tuple[str, list[str]]] = {}
    for setting, pct in WARMUP_PCT.items():
        for every in CHECKS:
            name = f"{setting}/check{every}"
            runs[name] = (str(out / setting / f"check{every}"),
                          [*BASE, f"train.steps={a.steps}",
                           f"train.warmup_steps={round(a.steps * pct / 100)}",
                           f"lowrank.check_every={every}", *a.overrides])
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        results = dict(zip(runs, pool.map(_run, list(runs.values()), chunksize=1)))
    missing = [n for n, r in results.items() if "switch_step" not in r]
    if missing:
        print(f"no switch in {', '.join(missing)}", file=sys.stderr)
        return 1
    for name, r in results.items():
        _print_run(name, r)
    pct = {n: 100.0 * r["switch_step"] / r["total_steps"] for n, r in results.items()}
    print("\n| setting | check_every 10 | check_every 40 | difference |")
    print("|---|---|---|---|")
    diffs = {}
    for setting in WARMUP_PCT:
        p10, p40 = pct[f"{setting}/check10"], pct[f"{setting}/check40"]
        diffs[setting] = abs(p10 - p40)
        print(f"| {setting} | {p10:.1f}% | {p40:.1f}% | {diffs[setting]:.1f}% |")
    means = [sum(pct[f"{s}/check{e}"] for e in CHECKS) / len(CHECKS) for s in WARMUP_PCT]
    checks = {
        "no switch forced by max_switch_frac": not any(r["forced"] for r in results.values()),
        "check_every 10 vs 40 within 2% of training, every setting":
            all(d <= 2.0 for d in diffs.values()),
        "the two settings switch >= 5% of training apart":
            abs(means[0] - means[1]) >= 5.0,
    }
    print(f"\nwall-clock: {time.time() - t0:.0f} s, {a.jobs} runs at a time; MLflow: "
          f"{os.environ['MLFLOW_TRACKING_URI']}; plots: {out}/*/*/signals.png")
    if a.smoke:
        print("(--smoke: a smoke test at CI size, no verdict)")
        return 0
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
