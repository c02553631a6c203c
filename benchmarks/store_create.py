"""A new sqlite MLflow store: MLflow's own creation (its schema migrations) vs a copy of the
cached empty schema (`workbench/track/sqlite_template.py`), each timed in a fresh process, the
way every new experiment folder, test and benchmark pays it before its first step.

    python benchmarks/store_create.py [--stores 5]

Each measurement is a fresh `python -c` that imports MLflow first (not timed), then opens a
store that does not exist yet and lists its experiments (timed); the two ways take turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import sys, time
from mlflow.tracking import MlflowClient
from workbench.track.store import client
uri = sys.argv[2]
t0 = time.perf_counter()
c = MlflowClient(tracking_uri=uri) if sys.argv[1] == "mlflow" else client(uri)
c.search_experiments(max_results=1)
print(time.perf_counter() - t0)
"""


def timed(way: str, store: Path, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, way, f"sqlite:///{store}"], env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stores", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wb-store-") as tmp:
        env = dict(os.environ, WORKBENCH_CACHE=str(Path(tmp) / "cache"),
                   MLFLOW_DISABLE_TELEMETRY="true")
        first = timed("workbench", Path(tmp) / "first.db", env)  # builds the cached template
        times: dict[str, list[float]] = {"mlflow": [], "workbench": []}
        for i in range(a.stores):
            for way in times:
                times[way].append(timed(way, Path(tmp) / f"{way}-{i}.db", env))
    own, copy = (statistics.median(times[w]) for w in ("mlflow", "workbench"))
    print(f"first store on this machine (builds the template): {first:.2f} s")
    print(f"new store, MLflow's migrations : {own:.3f} s (median of {a.stores})")
    print(f"new store, copy of the template: {copy:.3f} s (median of {a.stores})")
    print(f"ratio MLflow / copy: {own / copy:.0f}x, {own - copy:.2f} s saved per new store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
