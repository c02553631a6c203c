"""Measured cases for calibration from MLflow runs (`calibrate --mlflow-uri URI`).

A training run logs `pred/<name>` for every key of Estimate.as_metrics() at step 0 and the
measured `step_time_s` every step; its params hold the flattened config (`model.*`,
`cluster.*`, `train.*`) and `layout` (a Layout key). Each run that has both a prediction and a
measurement becomes one case whose measured figure is the median step time (the first step is
left out when there are others: it carries compilation and allocator warm-up).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict

import yaml

from workbench.compose import from_recorded
from workbench.config import ClusterConfig, RunConfig
from workbench.errors import ConfigError, InputError
from workbench.layout import Layout
from workbench.plan.accuracy.published import Case
from workbench.plan.cost.hardware import match_gpu
from workbench.plan.cost.stacks import software_for
from workbench.track.store import client as store_client

PRED_KEY, MEASURED_KEY = "pred/step_time_s", "step_time_s"


SECTIONS = ("model", "train", "cluster")  # the params a case is built from


def _recorded(params: dict[str, str], cluster: ClusterConfig, source: str) -> RunConfig:
    """The run's config from its `model.*`, `train.*` and `cluster.*` params (what the cost
    model reads; the cluster being calibrated fills what the run did not record), rebuilt and
    checked as every recorded config is (compose.from_recorded)."""
    nested: dict[str, dict] = {s: {} for s in SECTIONS}
    nested["cluster"] = {k: v for k, v in asdict(cluster).items() if k != "coeff"}
    for key, value in params.items():
        section, _, name = key.partition(".")
        if section in nested and name and "." not in name and value not in ("None", ""):
            nested[section][name] = None if value == "null" else _container(value)
    return from_recorded(nested, source)


def _container(value: str):
    """MLflow keeps a param as its str(); a dict or list field (cluster.coeff) is read back."""
    return yaml.safe_load(value) if value.startswith(("{", "[")) else value


def _measured(client, run_id: str) -> float | None:
    hist = sorted(client.get_metric_history(run_id, MEASURED_KEY), key=lambda m: m.step)
    values = [m.value for m in hist if m.value > 0]
    if len(values) > 1:
        values = values[1:]
    return statistics.median(values) if values else None


def _accelerator(name: str) -> str:
    """A known GPU by its datasheet name (loose spellings agree); any other accelerator, a CPU
    cluster's `cpu` say, by its own name: its figures come from the cluster YAML."""
    try:
        return match_gpu(name).name
    except KeyError:
        return name.strip().lower()


def load_mlflow_cases(uri: str, experiment: str | None, cluster: ClusterConfig
                      ) -> tuple[list[tuple[Case, str, float]], list[str]]:
    """(cases as (Case, 'seconds_per_iter', measured s), reasons runs were skipped)."""
    try:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # keep errors to one line

        client = store_client(uri, create=False)
        if experiment:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise InputError(f"--experiment {experiment}: no such experiment at {uri}")
            ids = [exp.experiment_id]
        else:
            ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, max_results=5000) if ids else []
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"--mlflow-uri {uri}: cannot read runs ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    cases, skipped = [], []
    for run in runs:
        rid, params = run.info.run_id, run.data.params
        if PRED_KEY not in run.data.metrics:
            skipped.append(f"{rid}: no {PRED_KEY}")
            continue
        try:
            gpu = params.get("cluster.gpu", cluster.gpu)
            if _accelerator(gpu) != _accelerator(cluster.gpu):
                skipped.append(f"{rid}: GPU {gpu} is not {cluster.gpu}")
                continue
            run = _recorded(params, cluster, f"the params of run {rid}")
            model, train, run_cluster = run.model, run.train, run.cluster
            layout = Layout.from_key(params["layout"])
        except (KeyError, ValueError, ConfigError, Exception) as e:
            skipped.append(f"{rid}: {type(e).__name__} {str(e)[:120]}")
            continue
        measured = _measured(client, rid)
        if measured is None:
            skipped.append(f"{rid}: no measured {MEASURED_KEY}")
            continue
        sw = software_for(train, run_cluster)
        cases.append((Case(model, cluster, train, layout, sw), "seconds_per_iter", measured))
    return cases, skipped
