"""`python -m workbench.run +sweep=NAME [overrides]`: Optuna proposes, the cost model filters,
the survivors run as one job array per round (or as local processes), and each result is told
to Optuna as soon as its trial finishes.

Every step first persists the trial's new status in sweeps/NAME/trials.json, so the driver may
be killed anywhere: `sweep.resume=true` re-reads the map, re-attaches to trials still running,
submits what was prepared, and never asks Optuna twice for the same trial.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from workbench.cli import guarded
from workbench.compose import to_run_config
from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.launch import threads_per_rank
from workbench.sweep import lowrank, mixture, report
from workbench.sweep.session import Sweep, from_state, load, start  # noqa: F401  (re-exported)
from workbench.sweep.space import params
from workbench.sweep.state import TrialRecord
from workbench.track.store import client

PREPARE_THREADS_HTTP = 8  # trials prepared at once against a tracking server (prepare_threads)
MAX_ATTEMPTS = 3  # a local trial whose process vanished is restarted (it resumes) this often


# ---------------------------------------------------------------------------- one trial
def ask(sw: Sweep, count: int) -> list[TrialRecord]:
    dists = params(sw.sweep)
    out = []
    for _ in range(count):
        trial = sw.study.ask(fixed_distributions=dists)
        out.append(sw.state.update(TrialRecord(number=trial.number, params=dict(trial.params)),
                                   save=False))
    sw.state.save()  # a driver killed before this leaves orphan Optuna trials: see recover()
    return out


def candidate(sw: Sweep, record: TrialRecord) -> tuple[RunConfig | None, str]:
    """The trial's run config with its layout checked and predicted, or (None, why not)."""
    from workbench.submit import choose_layout

    trial = sw.base.copy()
    for key, value in record.params.items():
        OmegaConf.update(trial, key, value, merge=False)
    trial.train.run_dir = str(sw.state.trial_dir(record.number))
    try:
        cfg = to_run_config(trial)
        layout = choose_layout(cfg, sw.world_size)
    except ConfigError as e:
        return None, f"invalid: {e}"
    if cfg.launcher.name != "slurm":  # local trials at once share this machine's cores
        cfg.train.threads = threads_per_rank(cfg.launcher, cfg.train.threads,
                                             sw.sweep.parallelism)
    record.layout = layout.key()
    try:
        from workbench.plan.cost.estimate import estimate

        est = estimate(cfg.model, cfg.cluster, cfg.train, layout, cfg.lowrank)
        record.pred = {k: float(v) for k, v in est.as_metrics().items()
                       if k in ("tokens_per_s", "step_time_s", "peak_mem_bytes", "fits", "mfu")}
        margin_gib = sw.sweep.mem_margin_gib
        if sw.sweep.reject_infeasible and not est.fits_with(margin_gib * 2**30):
            return None, (f"predicted out of memory: {est.peak_mem_bytes / 2**30:.2f} GiB"
                          f"{f' + {margin_gib:g} GiB margin' if margin_gib else ''} > "
                          f"{est.hbm_bytes / 2**30:.2f} GiB per device")
    except (ImportError, ValueError, ZeroDivisionError) as e:
        record.pred = {}
        print(f"warning: no cost-model prediction for trial {record.number}: {e}",
              file=sys.stderr)
    return cfg, ""


def reject_poor(sw: Sweep, records: list[TrialRecord]) -> None:
    """Reject layouts predicted slower than min_pred_ratio x the best predicted so far."""
    ratio = sw.sweep.min_pred_ratio
    if ratio <= 0:
        return
    preds = [r.pred.get("tokens_per_s", 0.0) for r in sw.state.trials.values()
             if r.status != "rejected" or r.reason.startswith("predicted slow")]
    top = max(preds, default=0.0)
    for r in records:
        pred = r.pred.get("tokens_per_s")
        if pred is not None and top > 0 and pred < ratio * top:
            reject(sw, r, f"predicted slow: {pred:.4g} tokens/s < {ratio} x best predicted "
                          f"{top:.4g}")


def set_attr(sw: Sweep, number: int, key: str, value: Any) -> None:
    """A user attribute on trial `number` (through the storage API: after a resume the driver
    holds no Trial objects, only numbers)."""
    set_attrs(sw, number, {key: value})


def set_attrs(sw: Sweep, number: int, attrs: dict[str, Any]) -> None:
    """Several user attributes on trial `number`, looking the trial up once (each lookup is a
    database round trip on an RDB storage)."""
    storage = sw.study._storage
    trial_id = storage.get_trial_id_from_study_id_trial_number(sw.study._study_id, number)
    if not storage.get_trial(trial_id).state.is_finished():
        for key, value in attrs.items():
            storage.set_trial_user_attr(trial_id, key, value)


def reject(sw: Sweep, record: TrialRecord, reason: str) -> None:
    import optuna

    set_attr(sw, record.number, "rejected", reason)
    sw.study.tell(record.number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)
    sw.state.update(record, save=False, status="rejected", reason=reason, told=True)
    print(f"trial {record.number} rejected ({record.layout or record.params}): {reason}",
          file=sys.stderr)


def prepare(sw: Sweep, records: list[TrialRecord]) -> None:
    """asked -> prepared (MLflow child run + job file) or -> rejected, without launching."""
    from workbench.job import JOB_NAME, Job
    from workbench.submit import prepare_job
    from workbench.sweep.space import overrides_of

    survivors = []
    for record in records:
        job_file = sw.state.trial_dir(record.number) / JOB_NAME
        if job_file.exists():  # prepared by a driver that died before recording it
            job = Job.load(job_file)
            sw.state.update(record, status="prepared", run_dir=job.run_dir, run_id=job.run_id,
                            layout=job.layout)
            continue
        cfg, why = candidate(sw, record)
        if cfg is None:
            reject(sw, record, why)
        else:
            survivors.append((record, cfg))
    reject_poor(sw, [r for r, _ in survivors])
    sw.state.save()  # the round's rejections (each already told to Optuna: idempotent on resume)
    survivors = [(r, cfg) for r, cfg in survivors if r.status != "rejected"]

    def make(item: tuple[TrialRecord, Any]) -> Any:  # Optuna's storages are thread-safe
        record, cfg = item
        tags = {"wb.sweep": sw.sweep.name, "wb.trial": str(record.number)}
        overrides = sw.sweep.overrides + sw.base_overrides + overrides_of(record.params)
        job = prepare_job(cfg, overrides, sw.world_size, tags, sw.state.plan["parent_run_id"])
        attrs = {"pred": record.pred} if record.pred and job.run_id else {}
        set_attrs(sw, record.number, attrs | {"layout": record.layout, "run_id": job.run_id})
        return job

    with ThreadPoolExecutor(max_workers=prepare_threads(sw.uri)) as pool:
        for (record, _), job in zip(survivors, pool.map(make, survivors)):
            sw.state.update(record, status="prepared", run_dir=job.run_dir, run_id=job.run_id)


def prepare_threads(uri: str) -> int:
    """Trials prepared at once. Over HTTP a trial's preparation is mostly waiting on the
    tracking server (about five round trips: create the run, its params and predictions, its
    two manifest files), so eight in flight hide the latency; a sqlite store serializes
    writers behind one file lock, where threads would only queue."""
    return PREPARE_THREADS_HTTP if uri.startswith(("http://", "https://")) else 1


def submit(sw: Sweep) -> None:
    """prepared -> submitted: one array for Slurm; as many processes as slots allow locally."""
    from workbench.job import Job

    ready = sw.state.with_status("prepared")[: sw.backend.wait_slots()]
    if not ready:
        return
    jobs = [Job.load(Path(r.run_dir)) for r in ready]
    ids = sw.backend.submit(ready, jobs)
    for record, job_id in zip(ready, ids):
        sw.state.update(record, save=False, status="submitted", job_id=job_id,
                        attempts=record.attempts + 1)
    sw.state.save()
    with ThreadPoolExecutor(max_workers=prepare_threads(sw.uri)) as pool:
        list(pool.map(lambda r_id: set_attr(sw, r_id[0].number, "job_id", r_id[1]),
                      zip(ready, ids)))
    print(f"submitted trials {[r.number for r in ready]} as {ids[0]}"
          f"{'..' + ids[-1] if len(ids) > 1 else ''}", file=sys.stderr)


def poll(sw: Sweep) -> int:
    """Tell Optuna every trial that ended since the last poll; returns how many did."""
    running = sw.state.with_status("submitted")
    if not running:
        return 0
    c = client(sw.uri)
    ended = sw.backend.ended(running)
    statuses = report.run_statuses(c, sw.state.plan["parent_run_id"],
                                   [r.run_id for r in running if r.run_id])
    told = 0
    for r in running:
        status = statuses.get(r.run_id, "FAILED") if r.run_id else "FAILED"
        if status == "FINISHED":
            values, why = report.measure(c, r.run_id, sw.objectives)
            if values is None:
                fail(sw, r, why)
            else:
                sw.state.update(r, status="complete", values=values)
                sw.study.tell(r.number, values, skip_if_finished=True)
                sw.state.update(r, told=True)
                shown = ", ".join(f"{o.metric}={v:.4g}" for o, v in zip(sw.objectives, values))
                print(f"trial {r.number} ({r.layout}): {shown}", file=sys.stderr)
        elif r.number in ended and ended[r.number] == "gone" and r.attempts < MAX_ATTEMPTS:
            sw.state.update(r, status="prepared")  # resubmit: it resumes its own checkpoint
            continue
        elif status in ("FAILED", "KILLED") and r.number not in ended \
                and sw.backend.requeued(r):
            continue  # Slurm queued it again (a lost node): the next attempt resumes the run
        elif status in ("FAILED", "KILLED") or r.number in ended:
            fail(sw, r, f"run {status.lower()}, job {r.job_id} {ended.get(r.number, '')}".strip())
        else:
            continue
        told += 1
    return told


def fail(sw: Sweep, record: TrialRecord, reason: str) -> None:
    import optuna

    sw.state.update(record, status="failed", reason=reason)
    set_attr(sw, record.number, "failed", reason)
    sw.study.tell(record.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    sw.state.update(record, told=True)
    print(f"trial {record.number} failed: {reason} (log: {record.run_dir})", file=sys.stderr)


def step(sw: Sweep) -> None:
    """One pass: ask a round when none is in flight, prepare, submit, poll."""
    n_left = sw.state.plan["budget"] - len(sw.state.trials)
    if n_left > 0 and not sw.state.in_flight():
        ask(sw, min(sw.sweep.array_size, n_left))
    prepare(sw, sw.state.with_status("asked"))
    submit(sw)
    if poll(sw):
        report.update_parent(sw.state, sw.uri, sw.objectives)


def submit_budget(sw: Sweep) -> None:
    """Detached: the whole budget asked, prepared and handed to the backend round by round,
    without waiting for a result. A Slurm array takes each round whole; local processes take
    what `sweep.parallelism` allows, and `collect` starts the rest as they end."""
    while len(sw.state.trials) < sw.state.plan["budget"]:
        ask(sw, min(sw.sweep.array_size, sw.state.plan["budget"] - len(sw.state.trials)))
        prepare(sw, sw.state.with_status("asked"))
        submit(sw)
    prepare(sw, sw.state.with_status("asked"))  # what a killed detached driver asked
    submit(sw)


def finished(sw: Sweep) -> bool:
    return len(sw.state.trials) >= sw.state.plan["budget"] and not sw.state.in_flight()


def drive(sw: Sweep, detach: bool = False, wait: bool = True) -> None:
    """The one sweep loop, whoever drives it (the driver, attached or detached, resumed, or
    `collect`): passes of `step` until every trial ended (`wait`) or one pass; detached, only
    the submissions. Whoever sees the last trial end finishes the sweep."""
    if detach:
        submit_budget(sw)
        report.update_parent(sw.state, sw.uri, sw.objectives)
        return
    while True:
        step(sw)
        if finished(sw) or not wait:
            break
        time.sleep(sw.sweep.poll_s)
    if finished(sw):
        finish(sw)
    else:
        report.update_parent(sw.state, sw.uri, sw.objectives)


def finish(sw: Sweep) -> None:
    """The end of a sweep: its recipe's comparison on the parent run (the low-rank modes'
    report, the mixtures' fitted weights), written once, however the sweep was driven (a
    detached sweep ends in `collect`); then the parent's final numbers, and it is closed."""
    if not sw.state.plan.get("finished"):
        if "lowrank" in sw.sweep.space:
            lowrank.finish(sw)
        if "weights" in sw.sweep.space.get("data", {}):
            mixture.finish(sw)
        sw.state.plan["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        sw.state.save_plan()
    report.update_parent(sw.state, sw.uri, sw.objectives, finished=True)


def run(sw: Sweep) -> int:
    """Drive the sweep to its budget (or, detached, submit everything and return)."""
    start(sw)
    try:
        drive(sw, detach=sw.sweep.detach)
    finally:
        sw.state.unlock()
    if sw.sweep.detach:
        waiting = len(sw.state.with_status("prepared"))
        later = f" ({waiting} wait for a slot: collect starts them)" if waiting else ""
        print(f"submitted{later}; follow with: python -m workbench.sweep status {sw.sweep.name}"
              f" (collect: python -m workbench.sweep collect {sw.sweep.name})")
    else:
        print(report.table(sw.state, sw.objectives))
    return 0


@guarded
def main(argv: list[str]) -> int:
    sw = load(argv)
    return run(sw)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
