"""The job file: everything a rank needs to train, frozen at submission.

Every launcher ends in `python -m workbench.train JOB_FILE`. The file holds the resolved config,
the concrete layout, the MLflow run id and the run folder, so a requeued job resumes the same run
with the same settings, whatever was edited in the working tree since.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from workbench.compose import from_recorded
from workbench.config import RunConfig
from workbench.layout import Layout

JOB_NAME = "job.json"
# What a multi-rank job returns: the loss-holding rank writes it into run_dir at the end, and the
# torchrun launcher reads it back (its driver never imports the rank code, nor torch).
FINAL_METRICS = "final_metrics.json"
# What a job runs on every rank, by kind: the module each launcher starts with `python -m`, and
# the module whose `run_job(job, progress, stop_requested)` an in-process rank calls.
ENTRIES = {"train": ("workbench.train", "workbench.rank"),
           "profile": ("workbench.profile.worker", "workbench.profile.worker")}


@dataclass
class Job:
    config: Dict[str, Any]  # the resolved RunConfig as plain data
    layout: str  # Layout.key()
    run_dir: str
    run_id: Optional[str] = None  # MLflow run; None with tracking=none
    data_dir: str = ""
    world_size: int = 1
    tags: Dict[str, str] = field(default_factory=dict)
    kind: str = "train"  # what every rank runs (ENTRIES): training, or a cluster profile
    task: Dict[str, Any] = field(default_factory=dict)  # what a non-training kind needs

    def command_module(self) -> str:
        return ENTRIES[self.kind][0]

    def run_on_this_rank(self, progress: bool = True, stop_requested: Any = None
                         ) -> Dict[str, float]:
        """Run this job's rank code in this process (the local and Slurm launchers)."""
        import importlib

        module = importlib.import_module(ENTRIES[self.kind][1])
        return module.run_job(self, progress=progress, stop_requested=stop_requested)

    def run_config(self) -> RunConfig:
        """The recorded config, checked as on the command line: a job file the code would no
        longer accept fails here, naming the key and this file, before any rank trains."""
        return from_recorded(self.config, str(self.path))

    def the_layout(self) -> Layout:
        return Layout.from_key(self.layout)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / JOB_NAME

    def save(self) -> Path:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".job.")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path | str) -> Job:
        path = Path(path)
        if path.is_dir():
            path = path / JOB_NAME
        if not path.exists():
            raise FileNotFoundError(f"job file {str(path)!r} does not exist")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise FileNotFoundError(f"job file {str(path)!r} is malformed ({e})") from None


def config_dict(cfg: RunConfig) -> Dict[str, Any]:
    """The run config as plain nested dicts. A RunConfig is already resolved and typed (built by
    OmegaConf.to_object), so dataclasses.asdict gives what a structured-config round trip gives
    at a hundredth of the cost, which a sweep driver pays once per trial."""
    return asdict(cfg)


def config_yaml(resolved: Dict[str, Any]) -> str:
    """YAML of a plain config dict (what OmegaConf.to_yaml writes, via libyaml when present)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(resolved, Dumper=dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True)


def flat_params(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}: the MLflow params of a run."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v
    return out
