"""8 local runs at once against the same 8 in turn: `python benchmarks/concurrent_runs.py`.

Starts N short runs of gpt_tiny (`python -m workbench.run`, each its own process, as a user or a
local sweep starts them) all at once, each told its share of the cores (`train.threads` = cores
// N, at least 1, what the local sweep backend gives each trial), and then the same N runs one
after another with torch's default threads; prints both wall times and their ratio. All runs
write one sqlite store in a temporary folder, created by a warm-up run first (which also builds
the corpus cache), so neither side pays for that. `--unshared` adds a third pass: N at once with
torch's default threads each (the oversubscription the share avoids).

Options: --runs N (default 8), --steps S (default 30), --unshared, --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_args(folder: Path, name: str, steps: int, threads: int) -> list[str]:
    args = [sys.executable, "-m", "workbench.run", f"train.steps={steps}",
            f"train.eval_every={steps}", "train.eval_batches=1", "train.ckpt_every=100000",
            "train.warmup_steps=1", "data.max_bytes=1000000", f"train.run_dir={folder / name}"]
    return args + ([f"train.threads={threads}"] if threads else [])


def timed(folder: Path, commands: list[list[str]], at_once: bool) -> float:
    """Wall seconds to run every command, all at once or one after another; any failure stops
    the benchmark (a failed run would make the time meaningless)."""
    t0 = time.perf_counter()
    logs = [open(folder / f"log-{time.monotonic_ns()}-{i}.txt", "w") for i in range(len(commands))]
    procs: list[subprocess.Popen] = []
    for cmd, log in zip(commands, logs):
        procs.append(subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT))
        if not at_once:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    if any(codes):
        raise SystemExit(f"runs failed with {codes}; logs in {folder}")
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--unshared", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    from workbench.launch.world import cores

    folder = Path(tempfile.mkdtemp(prefix="wb-concurrent-"))
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    n, share = args.runs, max(1, cores() // args.runs)
    timed(folder, [run_args(folder, "warmup", 1, 0)], at_once=False)
    at_once = timed(folder, [run_args(folder, f"c{i}", args.steps, share) for i in range(n)],
                    at_once=True)
    in_turn = timed(folder, [run_args(folder, f"s{i}", args.steps, 0) for i in range(n)],
                    at_once=False)
    print(f"{n} runs of {args.steps} steps (gpt_tiny, one process each) on {cores()} cores")
    print(f"  at once, train.threads={share} each:      {at_once:8.1f} s")
    print(f"  one after another, default threads:   {in_turn:8.1f} s")
    if args.unshared:
        unshared = timed(folder, [run_args(folder, f"u{i}", args.steps, 0) for i in range(n)],
                         at_once=True)
        print(f"  at once, default threads each:        {unshared:8.1f} s")
    print(f"concurrent / sequential wall time: {at_once / in_turn:.2f} (target: <= 1)")
    if args.keep:
        print(f"kept {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
