"""Concurrent load on the tracking server for tests/test_tracking_server.py, as one command:

    python tests/tracking_load.py mlflow URI EXPERIMENT RUNS STEPS
    python tests/tracking_load.py optuna STORAGE STUDY WORKERS TRIALS

Each of RUNS (WORKERS) processes is forked after the imports, so a process costs no 3.6 s import
of mlflow and the box's two cores go to the load itself; all start together (a barrier). mlflow:
each process creates its run with workbench's own create_run and logs STEPS steps of two metrics
through workbench's MlflowTracker (batched, a flush every 10 steps, as the training loop does).
optuna: each process runs TRIALS trials of one study on the RDB storage. Prints one JSON line;
exit status 1 when any process failed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import traceback


def _mlflow_worker(uri: str, experiment: str, steps: int, index: int, barrier, out) -> None:
    from workbench.config import TrackingConfig
    from workbench.track.tracker import MlflowTracker, create_run

    try:
        barrier.wait(timeout=120)
        cfg = TrackingConfig(backend="mlflow", uri=uri, experiment=experiment)
        run_id = create_run(cfg, f"load-{index}", {"load.index": str(index)})
        tracker = MlflowTracker(uri, run_id, flush_every_s=0.2)
        for step in range(steps):
            tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 1e-3 * index}, step)
            if step % 10 == 9:
                tracker.flush()
        tracker.close()
        out.put((index, run_id, ""))
    except BaseException:
        out.put((index, "", traceback.format_exc()[-2000:]))


def _optuna_worker(storage: str, study: str, trials: int, index: int, barrier, out) -> None:
    import optuna

    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        barrier.wait(timeout=120)
        s = optuna.load_study(study_name=study, storage=storage)

        def objective(trial) -> float:
            x = trial.suggest_float("x", -10, 10)
            trial.set_user_attr("worker", index)
            return (x - 2) ** 2

        s.optimize(objective, n_trials=trials)
        out.put((index, "", ""))
    except BaseException:
        out.put((index, "", traceback.format_exc()[-2000:]))


def main(argv: list) -> int:
    kind, target, name, n, per = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    if kind == "mlflow":
        import mlflow  # noqa: F401  (imported once, before the fork)

        from workbench.track import tracker  # noqa: F401

        worker = _mlflow_worker
    else:
        import optuna
        from optuna.storages import RDBStorage

        storage = RDBStorage(target)
        optuna.create_study(study_name=name, storage=storage, direction="minimize")
        storage.engine.dispose()  # no pooled connection crosses the fork
        del storage
        worker = _optuna_worker
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(target, name, per, i, barrier, out))
             for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [err for _, _, err in results if err]
    print(json.dumps({"ids": sorted(r for _, r, err in results if not err), "errors": errors}))
    return 1 if errors or any(p.exitcode for p in procs) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
