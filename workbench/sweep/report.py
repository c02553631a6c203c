"""Reading a sweep's results: measured objectives from each trial's MLflow run, the table that
`status` prints, the best trial(s), and what the parent MLflow run shows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from workbench.sweep.space import Objective
from workbench.sweep.state import SweepState, TrialRecord
from workbench.track.store import client

# Throughput-like metrics are the median over steps after the first (warm-up, allocation);
# quality metrics are the last value the run logged.
MEDIAN_METRICS = ("tokens_per_s", "mfu", "step_time_s")


def run_status(mlflow_client: Any, run_id: str) -> str:
    from workbench.track.tracker import with_retries

    return with_retries(mlflow_client.get_run, run_id).info.status


def run_statuses(mlflow_client: Any, parent_run_id: str, run_ids: Sequence[str]
                 ) -> dict[str, str]:
    """Status of many runs of one sweep in one search per 100 runs instead of a get_run each:
    a driver polling 64 running trials over HTTP otherwise pays 64 round trips every poll. A
    run the search does not return (logged to another experiment) is asked for by itself."""
    from workbench.track.tracker import with_retries

    ids = sorted(set(run_ids))
    if not ids:
        return {}
    exp_id = with_retries(mlflow_client.get_run, parent_run_id).info.experiment_id
    out: dict[str, str] = {}
    for i in range(0, len(ids), 100):
        quoted = ", ".join(f"'{r}'" for r in ids[i:i + 100])
        runs = with_retries(mlflow_client.search_runs, [exp_id],
                            filter_string=f"attributes.run_id IN ({quoted})",
                            max_results=100)
        out.update({r.info.run_id: r.info.status for r in runs})
    return out | {r: run_status(mlflow_client, r) for r in ids if r not in out}


def measure(mlflow_client: Any, run_id: str, objectives: Sequence[Objective]
            ) -> tuple[list[float] | None, str]:
    """The objective values of a finished run, or (None, why) when one was never logged."""
    from workbench.track.tracker import with_retries

    values = []
    for obj in objectives:
        hist = sorted(with_retries(mlflow_client.get_metric_history, run_id, obj.metric),
                      key=lambda m: m.step)
        if not hist:
            return None, f"objective {obj.metric} was never logged"
        if obj.metric in MEDIAN_METRICS:
            series = [m.value for m in hist[1:]] or [hist[0].value]
            values.append(float(statistics.median(series)))
        elif obj.metric == "peak_mem_bytes":
            values.append(max(m.value for m in hist))
        else:
            values.append(float(hist[-1].value))
    return values, ""


def _better(a: Sequence[float], b: Sequence[float], objectives: Sequence[Objective]) -> bool:
    """a dominates b: no worse in every objective, better in one."""
    sign = [1.0 if o.direction == "maximize" else -1.0 for o in objectives]
    no_worse = all(s * x >= s * y for s, x, y in zip(sign, a, b))
    return no_worse and any(s * x > s * y for s, x, y in zip(sign, a, b))


def best(state: SweepState, objectives: Sequence[Objective]) -> list[TrialRecord]:
    """The best complete trial (one objective) or the Pareto front (several)."""
    done = [r for r in state.with_status("complete") if r.values]
    if not done:
        return []
    if len(objectives) == 1:
        pick = max if objectives[0].direction == "maximize" else min
        return [pick(done, key=lambda r: r.values[0])]
    return [r for r in done if not any(_better(o.values, r.values, objectives) for o in done)]


def counts(state: SweepState) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in state.trials.values():
        out[r.status] = out.get(r.status, 0) + 1
    return out


def table(state: SweepState, objectives: Sequence[Objective], rejected: bool = False) -> str:
    """One line per trial (rejected ones counted, listed with rejected=True): what
    `python -m workbench.sweep status NAME` prints."""
    names = [o.metric for o in objectives]
    head = f"{'trial':>5}  {'status':<9} {'job':<12} {'layout':<34} " + \
        " ".join(f"{n:>12}" for n in names) + f" {'pred tok/s':>11}  params / reason"
    lines = [head]
    for r in sorted(state.trials.values(), key=lambda r: r.number):
        if r.status == "rejected" and not rejected:
            continue
        vals = " ".join(f"{v:>12.4g}" for v in r.values) if r.values else \
            " ".join(f"{'-':>12}" for _ in names)
        pred = r.pred.get("tokens_per_s")
        extra = r.reason or " ".join(f"{k}={v}" for k, v in sorted(r.params.items()))
        lines.append(f"{r.number:>5}  {r.status:<9} {r.job_id[:12]:<12} {r.layout[:34]:<34} "
                     f"{vals} {'-' if pred is None else format(pred, '.4g'):>11}  {extra}")
    tally = ", ".join(f"{k} {v}" for k, v in sorted(counts(state).items()))
    lines.append(f"{len(state.trials)} of {state.plan.get('budget', '?')} trials: {tally}"
                 f"{'' if rejected else f' (rejected ones with reasons: {state.rejected_path})'}")
    for r in best(state, objectives):
        shown = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, r.values))
        lines.append(f"best: trial {r.number} layout {r.layout} ({shown}) run {r.run_id}")
    return "\n".join(lines)


def update_parent(state: SweepState, uri: str, objectives: Sequence[Objective],
                  finished: bool = False) -> None:
    """Best-so-far metrics, the rejected layouts and the trial map on the sweep's parent run."""
    import time

    from mlflow.entities import Metric

    from workbench.track.tracker import with_retries

    run_id = state.plan.get("parent_run_id")
    if not run_id:
        return
    c = client(uri)
    now = int(time.time() * 1000)
    n_done = len(state.with_status("complete"))
    metrics = [Metric(f"sweep/{k}", float(v), now, n_done) for k, v in counts(state).items()]
    top = best(state, objectives)
    if len(objectives) == 1 and top:
        metrics.append(Metric(f"best/{objectives[0].metric}", top[0].values[0], now, n_done))
    if metrics:
        with_retries(c.log_batch, run_id, metrics=metrics)
    for path in (state.rejected_path, state.trials_path):
        with_retries(c.log_artifact, run_id, str(path), "sweep")
    if top:
        from mlflow.entities import RunTag

        with_retries(c.log_batch, run_id, tags=[
            RunTag("wb.best_trials", ",".join(str(r.number) for r in top)),
            RunTag("wb.best_layout", top[0].layout)])
    if finished:
        with_retries(c.set_terminated, run_id, "FINISHED")
