"""Full rank vs adaptive low rank vs fixed low rank vs PowerSGD on the CPU, DDP over 2 gloo ranks.

Runs `+sweep=lowrank_vs_fullrank` on a >= 10M-parameter model (gpt_small, 14M, at seq_len 128)
trained on the embedded corpus, every mode with the same data, seed and token budget, then
prints the comparison table (measured bytes per step, final val_loss and its gap to full rank,
tokens/s, switch step and whether the cap forced it, ranks) and checks the targets:

- adaptive sends >= 50% fewer bytes per step than full rank after the switch (measured);
- adaptive's final val_loss is within 1% of full rank's at equal tokens;
- the switch came from the detector, not from the max_switch_frac cap.

    python benchmarks/lowrank_cpu.py [--steps 150] [--modes off,adaptive,...] [--out DIR]
                                     [--name NAME] [--baseline SWEEP] [--smoke] [overrides...]

Exit 1 when a target is missed. `--smoke` (the README test: a cut model, a few steps, where the
switch is forced) runs the same sweep and report and prints no verdict.

On 2 shared CPU cores this takes tens of minutes (4 runs of a 14M model; `--modes off,adaptive`
halves it; `--modes off --name base --out D`, then `--modes adaptive --baseline base --out D`
runs them one at a time, for a shared machine's lock). At 150 steps the stable ranks are still
falling and the switch is forced; the detector needs a run whose spectra settle (README,
Low-rank training: 300 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL = ["model=gpt_small", "model.seq_len=128", "train.global_batch=8",
         "train.micro_batch=4", "train.lr=2e-3", "train.warmup_steps=15",
         "train.eval_every=25", "train.eval_batches=2"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--modes", default="off,adaptive,fixed,powersgd",
                    help="the lowrank.mode values to compare (off is the baseline)")
    ap.add_argument("--out", default="")
    ap.add_argument("--name", default="lowrank_cpu", help="the sweep's name under OUT/sweeps")
    ap.add_argument("--baseline", default="",
                    help="a sweep under the same --out (say, `--modes off --name base`) whose "
                         "runs join the comparison: each mode can run as its own invocation")
    ap.add_argument("--smoke", action="store_true",
                    help="a smoke test at CI size: the sweep and its report, no verdict")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # README tests append --steps after the overrides
    out = Path(a.out or f"bench-lowrank-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    name = a.name
    cmd = [sys.executable, "-m", "workbench.run", "+sweep=lowrank_vs_fullrank",
           f"sweep.name={name}", *MODEL, f"train.steps={a.steps}", *a.overrides]
    modes = a.modes.split(",")
    if modes != ["off", "adaptive", "fixed", "powersgd"]:
        cmd += [f"sweep.space.lowrank.mode=[{','.join(modes)}]", f"sweep.n_trials={len(modes)}",
                f"sweep.array_size={len(modes)}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, check=False)
    wall_s = time.time() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    report = out / "sweeps" / name / "report"
    if a.baseline:
        report = report.with_name("report_with_baseline")
        proc = subprocess.run([sys.executable, "-m", "workbench.report", name, a.baseline,
                               "--sweeps-dir", str(out / "sweeps"), "--out", str(report)],
                              cwd=out, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
    rows = json.loads((report / "summary.json").read_text())
    print((report / "report.md").read_text())
    by = {r["run"]: r for r in rows}
    ad = by.get("adaptive", {})
    frac = float(ad.get("switch_frac") or "nan")
    checks = {
        "adaptive bytes/step reduction >= 50%": ad.get("bytes_reduction_pct", 0) >= 50.0,
        "adaptive val_loss within 1% of full rank": ad.get("val_loss_gap_pct", 1e9) <= 1.0,
        f"switch by the detector (at {100 * frac:.1f}% of training), not forced by the cap":
            ad.get("switch_forced") == "no",
    }
    print(f"\nsweep wall-clock: {wall_s:.0f} s; report: {report}")
    if not ad:
        print("no adaptive run here: nothing to check (see --baseline)")
        return 0
    if a.smoke:
        print("(--smoke: a smoke test at CI size, no verdict)")
        return 0
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
