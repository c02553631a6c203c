"""Which signal to decide the switch on: replays the detector on the signals an adaptive run
logged at every check, for each signal and threshold, checking every check (as the run did) and
every 4th check (as check_every x 4 would), so that a signal can be judged on one real run.

    python -m workbench.run lowrank=adaptive lowrank.threshold=1e-9 lowrank.max_switch_frac=1 \\
        train.steps=1000 train.run_dir=runs/observe      # never switches before its last step
    python benchmarks/lowrank_signals.py runs/observe

Prints, per signal and threshold, the switch point (% of training) at both check spacings and
how many layers were still open at the end; and the top-k subspace overlap between checks.
A good signal fires (not on the cap), does so at the same point at both spacings, and leaves
ranks that have stopped moving (`rank`: the integer rank the switch would use).
"""

from __future__ import annotations

import argparse
import glob
import math
import statistics
import sys

import torch

from workbench.lowrank.detector import Criterion, SwitchDetector
from workbench.lowrank.signals import SIGNALS


def levels(state: dict, signal: str) -> dict[str, list[tuple[float, float]]]:
    """Per layer: (step, level in % of full rank) at every logged check."""
    out = {}
    for name, rows in state["history"].items():
        full, scale, travel, seq = min(state["shapes"][name]), state["scales"][name], 0.0, []
        for step, sr, rank, erank, ov, _ in rows:
            travel += math.sqrt(max(0.0, 1 - ov))
            seq.append((step, {"rank": 100 * rank / full,
                               "stable_rank": 100 * min(1.0, scale * sr / full),
                               "energy_rank": 100 * erank / full,
                               "subspace": 100 * travel}[signal]))
        out[name] = seq
    return out


def replay(lv: dict[str, list[tuple[float, float]]], total: int, crit: Criterion,
           every: int) -> tuple[float | None, int]:
    """(% of training at which every layer latched or None, layers open at the end)."""
    det, names = SwitchDetector(crit), sorted(lv)
    for i in range(0, len(lv[names[0]]), every):
        step = lv[names[0]][i][0]
        det.observe(100 * step / total, {n: lv[n][i][1] for n in names})
        if det.settled():
            return 100 * step / total, 0
    return None, det.n_open()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--thresholds", default="0.25,0.5,1,2")
    a = ap.parse_args()
    # a folder per layout and step; the low-rank hooks' state is in rank 0's extras
    ckpts = sorted(glob.glob(f"{a.run_dir}/checkpoints/*/step_*/extra_rank00000.pt"))
    if not ckpts:
        print(f"error: {a.run_dir}: no checkpoint (run_dir of a finished run?)", file=sys.stderr)
        return 2
    return _print(a, torch.load(ckpts[-1], weights_only=False)["lowrank"])


def _print(a: argparse.Namespace, state: dict) -> int:
    import json
    from pathlib import Path

    cfg = json.loads((Path(a.run_dir) / "job.json").read_text())["config"]
    total, warm = cfg["train"]["steps"], cfg["train"]["warmup_steps"]
    lr = cfg["lowrank"]
    every = lr["check_every"]
    print(f"{a.run_dir}: {total} steps, warm-up {warm}, signals every {every} steps")
    print("| signal | threshold | switch @ every check | @ every 4th check | open at end |")
    print("|---|---|---|---|---|")
    for signal in SIGNALS:
        lv = levels(state, signal)
        for thr in (float(t) for t in a.thresholds.split(",")):
            crit = Criterion(thr, lr["smooth_pct"], lr["window_pct"], 100.0 * warm / total,
                             lr.get("straggler_frac", 0.1), lr["straggler_relax"])
            (p1, open1), (p4, _) = replay(lv, total, crit, 1), replay(lv, total, crit, 4)
            fmt = lambda p: "-" if p is None else f"{p:.1f}%"  # noqa: E731
            print(f"| {signal} | {thr:g} | {fmt(p1)} | {fmt(p4)} | {open1} |")
    late = [r[4] for rows in state["history"].values() for r in rows[len(rows) // 2:]]
    if late:
        print(f"\ntop-k subspace overlap between consecutive checks, second half of the run: "
              f"median {statistics.median(late):.3f}, min {min(late):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
