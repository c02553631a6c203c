"""How much the sweep driver costs, apart from training: `python benchmarks/sweep_overhead.py`.

Builds a 64-trial sweep (64 seeds of gpt_tiny) in a temporary folder and times each driver
stage: asking Optuna and preparing the trials (config, layout check, cost-model prediction, the
MLflow child run and the job file), submitting them as one Slurm job array (held, so nothing
trains; cancelled afterwards), and one poll of all 64 (sacct + MLflow). Without a Slurm cluster
the submission is skipped and reported as such.

Options: --trials N (default 64), --keep (leave the temporary folder).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def slurm_available() -> bool:
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                         check=False)
    return out.returncode == 0 and any(s.rstrip("*") in ("idle", "mixed", "allocated")
                                       for s in out.stdout.split())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="wb-sweep-bench-"))
    os.chdir(folder)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    from workbench.sweep import driver

    slurm = slurm_available()
    launcher = ["launcher=slurm", "+launcher.extra_sbatch.hold=true"] if slurm else []
    seeds = ",".join(str(i) for i in range(args.trials))
    argv_run = ["+sweep=seeds", f"sweep.space.train.seed=[{seeds}]",
                f"sweep.n_trials={args.trials}", f"sweep.array_size={args.trials}", *launcher]
    t0 = time.perf_counter()
    sw = driver.load(argv_run)
    driver.start(sw)  # plan, Optuna study, parent MLflow run
    t1 = time.perf_counter()
    driver.ask(sw, args.trials)
    t2 = time.perf_counter()
    driver.prepare(sw, sw.state.with_status("asked"))
    t3 = time.perf_counter()
    submit_s = float("nan")
    poll_s = float("nan")
    if slurm:
        driver.submit(sw)
        t4 = time.perf_counter()
        submit_s = t4 - t3
        driver.poll(sw)
        poll_s = time.perf_counter() - t4
        ids = sorted({r.job_id.split("_")[0] for r in sw.state.with_status("submitted")})
        subprocess.run(["scancel", *ids], check=False)
    sw.state.unlock()
    n = args.trials
    per_trial_ms = 1000 * ((t2 - t1) + (t3 - t2) + (0.0 if math.isnan(poll_s) else poll_s)) / n
    print(f"sweep of {n} trials ({'Slurm' if slurm else 'no Slurm: submission not measured'})")
    print(f"  load + start (compose, study, parent run):  {t1 - t0:8.2f} s")
    print(f"  ask {n} proposals from Optuna:              {t2 - t1:8.2f} s")
    print(f"  prepare {n} trials (run + job file each):   {t3 - t2:8.2f} s")
    print(f"  submit the {n}-trial array (one sbatch):     {submit_s:8.2f} s")
    print(f"  one poll of {n} running trials:             {poll_s:8.2f} s")
    print(f"driver overhead per trial (ask + prepare + one poll): {per_trial_ms:.0f} ms")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"kept {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
