"""How much the sweep driver costs, apart from training: `python benchmarks/sweep_overhead.py`.

Builds a 64-trial sweep (64 seeds of gpt_tiny) in a temporary folder and times each driver
stage: asking Optuna and preparing the trials (config, layout check, cost-model prediction, the
MLflow child run and the job file), submitting them as one Slurm job array (held, so nothing
trains; cancelled afterwards), and one poll of all 64 (sacct + MLflow). Without a Slurm cluster
the submission is skipped and reported as such.

It does so twice in one run when a tracking server answers at $WORKBENCH_TRACKING_URI (from
`python -m workbench.track.server start`): on the sqlite store and Optuna journal file of one
machine, then on the server (`tracking=server`) with the study in PostgreSQL
(`sweep.storage=$WORKBENCH_OPTUNA_STORAGE`), and prints the two side by side.

Options: --trials N (default 64), --keep (leave the temporary folders).
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


def measure(n: int, slurm: bool, extra: list[str], uri: str, keep: bool) -> dict:
    """Seconds of each driver stage for an n-trial sweep writing to `uri`."""
    folder = Path(tempfile.mkdtemp(prefix="wb-sweep-bench-"))
    os.chdir(folder)
    os.environ["MLFLOW_TRACKING_URI"] = uri or f"sqlite:///{folder / 'mlflow.db'}"
    from workbench.sweep import driver

    launcher = ["launcher=slurm", "+launcher.extra_sbatch.hold=true"] if slurm else []
    seeds = ",".join(str(i) for i in range(n))
    argv_run = ["+sweep=seeds", f"sweep.space.train.seed=[{seeds}]", f"sweep.n_trials={n}",
                f"sweep.array_size={n}", *launcher, *extra]
    t = {"t0": time.perf_counter()}
    sw = driver.load(argv_run)
    driver.start(sw)  # plan, Optuna study, parent MLflow run
    t["t1"] = time.perf_counter()
    driver.ask(sw, n)
    t["t2"] = time.perf_counter()
    driver.prepare(sw, sw.state.with_status("asked"))
    t["t3"] = time.perf_counter()
    out = {"start": t["t1"] - t["t0"], "ask": t["t2"] - t["t1"], "prepare": t["t3"] - t["t2"],
           "submit": float("nan"), "poll": float("nan")}
    if slurm:
        driver.submit(sw)
        t4 = time.perf_counter()
        out["submit"] = t4 - t["t3"]
        driver.poll(sw)
        out["poll"] = time.perf_counter() - t4
        ids = sorted({r.job_id.split("_")[0] for r in sw.state.with_status("submitted")})
        subprocess.run(["scancel", *ids], check=False)
    sw.state.unlock()
    poll = 0.0 if math.isnan(out["poll"]) else out["poll"]
    out["per_trial_ms"] = 1000 * (out["ask"] + out["prepare"] + poll) / n
    if keep:
        print(f"kept {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def warm_up() -> None:
    """Pay the once-per-process costs (imports of mlflow, optuna and torch; reading the
    installed packages for the manifest) before either side is timed, so that the side measured
    first is not charged for them."""
    import mlflow  # noqa: F401
    import optuna  # noqa: F401

    from workbench.track import manifest

    manifest.pip_freeze(), manifest.versions(), manifest.hardware()


def server_extra() -> tuple[str, list[str]]:
    """The tracking server's URI and the overrides that put a sweep on it, or ('', [])."""
    uri = os.environ.get("WORKBENCH_TRACKING_URI", "")
    storage = os.environ.get("WORKBENCH_OPTUNA_STORAGE", "")
    if not (uri and storage):
        return "", []
    try:
        from workbench.track.store import check_reachable

        check_reachable(uri)
    except Exception:
        return "", []
    name = f"seeds_{os.getpid()}_{int(time.time())}"  # its own study in the shared database
    return uri, ["tracking=server", f"sweep.storage={storage}", f"sweep.name={name}",
                 f"tracking.experiment=bench-{name}"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    n, slurm = args.trials, slurm_available()
    warm_up()
    cols = {"sqlite + journal": measure(n, slurm, [], "", args.keep)}
    uri, extra = server_extra()
    if uri:
        cols["server + PostgreSQL"] = measure(n, slurm, extra, uri, args.keep)
    print(f"sweep of {n} trials ({'Slurm' if slurm else 'no Slurm: submission not measured'})"
          + ("" if uri else "; no tracking server at $WORKBENCH_TRACKING_URI: sqlite only"))
    rows = [("load + start (compose, study, parent run), s", "start"),
            (f"ask {n} proposals from Optuna, s", "ask"),
            (f"prepare {n} trials (run + job file each), s", "prepare"),
            (f"submit the {n}-trial array (one sbatch), s", "submit"),
            (f"one poll of {n} running trials, s", "poll"),
            ("driver overhead per trial (ask + prepare + poll), ms", "per_trial_ms")]
    print(f"  {'':<52}" + "".join(f"{k:>20}" for k in cols))
    for label, key in rows:
        print(f"  {label:<52}" + "".join(f"{c[key]:>20.2f}" for c in cols.values()))
    for name, c in cols.items():
        print(f"driver overhead per trial, {name}: {c['per_trial_ms']:.0f} ms")
    if uri:
        server, lite = cols["server + PostgreSQL"], cols["sqlite + journal"]
        ratio = server["per_trial_ms"] / lite["per_trial_ms"]
        print(f"server / sqlite: {ratio:.2f}x (target: at most 150 ms per trial on the server)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
