"""What the workbench loop costs over a bare hand-written PyTorch loop.

Same model (gpt_tiny by default), same data, same batch, same process, alternating trials so that
machine noise hits both. The workbench side is the real `loop.train` as one rank runs it (the
engine over a one-rank process group) with MLflow tracking (sqlite), the progress bar and a DCP
checkpoint; the bare side is forward / backward / clip / AdamW step.
Also measures the time from command start to the first training step of `python -m
workbench.run` (a fresh process, cold imports) and the CPU seconds of that 2-step command, next to
the same command with CPython's default garbage-collector thresholds (workbench/startup.py).

    python benchmarks/loop_overhead.py [--steps 60] [--trials 3] [overrides...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbench.compose import compose
from workbench.data.corpus import batch_offsets, gather, load
from workbench.job import Job
from workbench.submit import prepare_job
from workbench.track.tracker import make_tracker
from workbench.train import loop
from workbench.train.checkpoint.folder import CheckpointDir
from workbench.train.checkpoint.names import layout_folder
from workbench.train.engine.mesh_engine import make_engine
from workbench.train.model import build, cross_entropy, flops_per_token
from workbench.train.optimizer import lr_at, make_optimizer
from workbench.train.parallel import comm

WARMUP = 5


def bare_tokens_per_s(cfg, data, steps: int) -> float:
    """The hand-written baseline: nothing but the math of a training step."""
    model = build(cfg.model, cfg.train.seed)
    opt = make_optimizer(list(model.parameters()), cfg)
    tokens = data.train.array()
    seq, n = cfg.model.seq_len, cfg.train.global_batch
    t_start = 0.0
    for step in range(steps):
        if step == WARMUP:
            t_start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = gather(tokens, batch_offsets(cfg.train.seed, "train", step, n, len(tokens), seq),
                      seq)
        loss = cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
    return (steps - WARMUP) * n * seq / (time.perf_counter() - t_start)


def workbench_tokens_per_s(cfg, job: Job, steps: int) -> float:
    """The real loop, timed from the end of the warm-up steps to the end of the last step
    (logging, progress callback and the final checkpoint included; evaluation excluded)."""
    shutil.rmtree(Path(job.run_dir) / "checkpoints", ignore_errors=True)
    marks = {}

    def on_step(step: int, _m) -> None:
        if step == WARMUP - 1:
            marks["start"] = time.perf_counter()
        if step == steps - 1:
            marks["end"] = time.perf_counter()

    tracker = make_tracker(cfg.tracking, job.run_id, owns_metrics=True)
    counter = comm.ByteCounter()
    with comm.process_group("cpu", 0, 1, counter):  # as the rank entry runs one process
        engine = make_engine(build(cfg.model, cfg.train.seed), cfg, job.the_layout(), 0,
                             torch.device("cpu"), counter)
        ckpt = CheckpointDir(layout_folder(job.run_dir, job.layout), engine.bookkeeping)
        ctx = loop.LoopContext(cfg=cfg, layout=job.the_layout(), engine=engine,
                               data=load(cfg.data), tracker=tracker, ckpt=ckpt,
                               flops_per_token=flops_per_token(cfg.model),
                               peak_flops_per_device=cfg.cluster.peak_fp32_flops, world_size=1,
                               on_step=on_step)
        loop.train(ctx)
    tracker.close()
    return (steps - WARMUP) * cfg.train.global_batch * cfg.model.seq_len / (
        marks["end"] - marks["start"])


# The baseline of the startup figure: the same command with CPython's default collector
# thresholds (workbench/startup.py's setting undone before the workbench loads).
DEFAULT_GC = ("import runpy, sys; import workbench.startup as s; s.fewer_gc_passes = lambda: None; "
              "sys.argv = ['workbench.run'] + sys.argv[1:]; "
              "runpy.run_module('workbench.run', run_name='__main__')")


def time_to_first_step_s(workdir: Path, default_gc: bool = False) -> tuple[float, float]:
    """A fresh `python -m workbench.run` of 2 steps: seconds from command start to its first
    training step (the metric the loop logs) and the CPU seconds of the whole command."""
    db = workdir / f"cold-{time.monotonic_ns()}.db"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{db}")
    head = [sys.executable, "-c", DEFAULT_GC] if default_gc else [sys.executable, "-m",
                                                                   "workbench.run"]
    cpu0 = _children_cpu_s()
    out = subprocess.run([*head, "train.steps=2", "train.eval_every=100"], cwd=workdir, env=env,
                         capture_output=True, text=True)
    cpu_s = _children_cpu_s() - cpu0
    if out.returncode:
        raise SystemExit(out.stderr)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])[0]
    return run.data.metrics["time_to_first_step_s"], cpu_s


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def startup(workdir: Path, trials: int) -> None:
    """The startup figure and its baseline, in alternating trials (medians)."""
    ours, default = [], []
    for _ in range(trials):
        ours.append(time_to_first_step_s(workdir))
        default.append(time_to_first_step_s(workdir, default_gc=True))
    first, cpu = (statistics.median(x) for x in zip(*ours))
    first0, cpu0 = (statistics.median(x) for x in zip(*default))
    print(f"time from command start to first training step: {first:.1f} s; the 2-step command "
          f"{cpu:.1f} CPU-s (median of {trials})")
    print(f"  with CPython's default GC thresholds: {first0:.1f} s; {cpu0:.1f} CPU-s; "
          f"ratio {cpu / cpu0:.2f} of the CPU, {first / first0:.2f} of the time to first step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    os.chdir(work)
    cfg = compose([f"train.steps={args.steps}", f"train.eval_every={10 * args.steps}",
                   f"train.ckpt_every={args.steps}", f"train.run_dir={work / 'run'}",
                   f"tracking.uri=sqlite:///{work / 'mlflow.db'}", *args.overrides])
    job = prepare_job(cfg, args.overrides, 1)
    data = load(cfg.data)
    print(f"model {cfg.model.name}, batch {cfg.train.global_batch}x{cfg.model.seq_len}, "
          f"{args.steps} steps ({WARMUP} warm-up), {torch.get_num_threads()} threads")
    bare, wb = [], []
    for trial in range(args.trials):
        bare.append(bare_tokens_per_s(cfg, data, args.steps))
        wb.append(workbench_tokens_per_s(cfg, job, args.steps))
        print(f"  trial {trial}: bare {bare[-1]:.0f} tok/s, workbench {wb[-1]:.0f} tok/s")
    b, w = statistics.median(bare), statistics.median(wb)
    print(f"bare loop       : {b:10.0f} tokens/s (median of {args.trials})")
    print(f"workbench loop  : {w:10.0f} tokens/s (median of {args.trials})")
    print(f"ratio workbench/bare: {w / b:.3f} (target >= 0.95)")
    startup(work, args.trials)


if __name__ == "__main__":
    main()
