"""Metrics per second from one rank: the tracking server (HTTP, batched) against the sqlite store.

`python benchmarks/tracking_throughput.py [--steps 2000] [--metrics 8] [--uri URI]` logs the
same stream (STEPS steps of METRICS metrics each, the loop's per-step set) through the
workbench's own `MlflowTracker` (queued, written by its background thread in `log_batch` calls)
into a fresh sqlite store and into the tracking server (`--uri`, default
$WORKBENCH_TRACKING_URI from `python -m workbench.track.server start`), in one run. Two
patterns, both timed from the first metric until the store holds them all:

- streamed: the loop only queues; the writer thread drains every second and `flush()` at the
  end waits for the rest (what a run does between checkpoints);
- per step: `flush()` after every step, a round trip per step (the worst case: a checkpoint or
  a requeue flag every step).

Every stored series is read back and checked complete (each step once) before a figure is
printed. Prints metrics/s for each store and pattern and the server's ratio to sqlite.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def one(uri: str, steps: int, metrics: int, per_step: bool) -> float:
    """metrics/s for one run on `uri`; asserts the store holds every step of every metric once."""
    from workbench.config import TrackingConfig
    from workbench.track.store import client
    from workbench.track.tracker import MlflowTracker, create_run

    run_id = create_run(TrackingConfig(uri=uri, experiment="bench-tracking-throughput"),
                        f"throughput-{'step' if per_step else 'stream'}", {})
    assert run_id is not None
    tracker = MlflowTracker(uri, run_id)
    keys = [f"m{i}" for i in range(metrics)]
    t0 = time.perf_counter()
    for step in range(steps):
        tracker.log_metrics({k: step * 0.5 + i for i, k in enumerate(keys)}, step)
        if per_step:
            tracker.flush()
    tracker.flush()
    dt = time.perf_counter() - t0
    tracker.close()
    c = client(uri)
    for k in (keys[0], keys[-1]):
        got = sorted(m.step for m in c.get_metric_history(run_id, k))
        assert got == list(range(steps)), (uri, k, len(got))
    return steps * metrics / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--metrics", type=int, default=8)
    ap.add_argument("--uri", default=os.environ.get("WORKBENCH_TRACKING_URI", ""))
    a = ap.parse_args()
    if not a.uri.startswith(("http://", "https://")):
        print("tracking_throughput: --uri (or $WORKBENCH_TRACKING_URI) must name a tracking "
              "server; start one with: python -m workbench.track.server start", file=sys.stderr)
        return 2
    from workbench.track.store import check_reachable

    check_reachable(a.uri)
    per_step_steps = max(1, a.steps // 10)  # a round trip a step: fewer steps, same metric
    with tempfile.TemporaryDirectory() as d:
        sqlite = f"sqlite:///{Path(d) / 'mlflow.db'}"
        rows = []
        for pattern, steps, per_step in (("streamed", a.steps, False),
                                         ("per step", per_step_steps, True)):
            lite = one(sqlite, steps, a.metrics, per_step)
            server = one(a.uri, steps, a.metrics, per_step)
            rows.append((pattern, steps, lite, server))
    print(f"{a.metrics} metrics a step, one rank; server {a.uri}")
    print(f"{'pattern':<10} {'steps':>6} {'sqlite metrics/s':>17} {'server metrics/s':>17} "
          f"{'server/sqlite':>14}")
    for pattern, steps, lite, server in rows:
        print(f"{pattern:<10} {steps:>6} {lite:>17,.0f} {server:>17,.0f} {server / lite:>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
