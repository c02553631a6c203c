"""`python -m workbench.rerun RUN_ID|RUN_DIR`: run again exactly what an MLflow run ran (a run
folder names its run through its job file).

The config comes from the run's manifest artifact, not from the current conf/ files, so a rerun
reproduces the original even after presets changed; what did change in the code or environment
since (commit, uncommitted edits, packages, torch, data) is printed before training starts.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import List

from workbench.cli import guarded
from workbench.compose import from_recorded
from workbench.config import TrackingConfig
from workbench.data.corpus import load as load_data
from workbench.errors import InputError
from workbench.launch import world_size
from workbench.submit import launch, prepare_job, summary
from workbench.track import manifest as manifests
from workbench.track.store import check_tracking, client


def fetch_manifest(tracking: TrackingConfig, run_id: str) -> dict:
    """The run's recorded manifest (its resolved config among it)."""
    from mlflow.exceptions import MlflowException

    c = client(tracking.resolved_uri(), create=False)
    try:
        c.get_run(run_id)
    except MlflowException:
        raise InputError(f"run_id={run_id!r}: no such run in {tracking.resolved_uri()}") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = c.download_artifacts(run_id, "manifest/manifest.json", tmp)
        except (MlflowException, OSError):
            raise InputError(f"run_id={run_id!r}: has no manifest/manifest.json artifact; "
                             "it was not recorded by workbench.run") from None
        return json.loads(Path(path).read_text())


def _from_run_dir(folder: Path) -> tuple[str, str]:
    """A run folder's MLflow run id and store, read from its job file."""
    from workbench.job import Job

    job = Job.load(folder)
    if not job.run_id:
        raise InputError(f"run_dir={str(folder)!r}: its run was not tracked (tracking=none)")
    return job.run_id, job.run_config().tracking.uri


@guarded
def main(argv: List[str]) -> int:
    if len(argv) < 1:
        raise InputError("usage: python -m workbench.rerun RUN_ID|RUN_DIR [tracking.uri=URI]")
    run_id, rest = argv[0], argv[1:]
    tracking = TrackingConfig()
    if Path(run_id).is_dir():
        run_id, tracking.uri = _from_run_dir(Path(run_id))
    for ov in rest:
        key, _, value = ov.partition("=")
        if key != "tracking.uri":
            raise InputError(f"{ov}: only tracking.uri=URI may follow the run id")
        tracking.uri = value
    old = fetch_manifest(tracking, run_id)  # a store missing or silent: one line, now
    cfg = from_recorded(old["config_yaml"], f"the manifest of run {run_id}")
    cfg.train.run_dir = ""  # a new run folder; the original stays untouched
    cfg.tracking.uri = tracking.uri or cfg.tracking.uri
    check_tracking(cfg)
    current = manifests.build(old["config_yaml"], old.get("overrides", []), cfg.train.seed,
                              load_data(cfg.data).fingerprint)
    diffs = manifests.differences(old, current)
    for line in diffs:
        print(f"differs from the original: {line}", file=sys.stderr)
    if not diffs:
        print("code, environment and data match the original run", file=sys.stderr)
    tags = {"wb.rerun_of": run_id, "wb.rerun_differs": str(bool(diffs)).lower()}
    job = prepare_job(cfg, old.get("overrides", []), world_size(cfg.launcher), extra_tags=tags)
    last = launch(cfg, job)
    print(summary(cfg, job, last))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
