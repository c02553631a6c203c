"""The one rank entry point: `python -m workbench.train JOB_FILE`.

Every launcher (local, torchrun, Slurm) ends here with the same job file; the code below never
knows how it was started. World size and rank come from the environment torchrun or Slurm set.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

import torch

from workbench.cli import guarded
from workbench.data.corpus import open_tokens
from workbench.job import Job
from workbench.track.tracker import make_tracker
from workbench.train import loop
from workbench.train.checkpoint import CheckpointDir
from workbench.train.engine import LocalEngine
from workbench.train.model import build, flops_per_token


def peak_flops(cfg) -> float:
    c = cfg.cluster
    if c.device == "cpu":
        return c.peak_fp32_flops
    return c.peak_bf16_flops if cfg.train.dtype == "bf16" else c.peak_fp32_flops


def world_from_env() -> Dict[str, int]:
    env = os.environ
    return {"rank": int(env.get("RANK", env.get("SLURM_PROCID", 0))),
            "world_size": int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1))),
            "local_rank": int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))}


def make_engine(job: Job, cfg, world: Dict[str, int]):
    layout = job.the_layout()
    device = torch.device("cuda", world["local_rank"]) if cfg.cluster.device == "cuda" \
        else torch.device("cpu")
    model = build(cfg.model, cfg.train.seed, device)
    if world["world_size"] == 1:
        return LocalEngine(model, device, cfg.train.dtype, layout.recompute, cfg.train.compile)
    from workbench.train.parallelize import make_parallel_engine

    return make_parallel_engine(model, cfg, layout, world, device)


def run_job(job: Job, progress: bool = True) -> Dict[str, float]:
    """Train the job to its last step (resuming if it has checkpoints); returns final metrics."""
    cfg = job.run_config()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    world = world_from_env()
    if world["world_size"] != job.world_size:
        raise RuntimeError(f"job expects world size {job.world_size}, got {world['world_size']}")
    engine = make_engine(job, cfg, world)
    tracker = make_tracker(cfg.tracking, job.run_id, owns_metrics=engine.is_main)
    bar = _progress(cfg.train.steps) if progress and engine.is_main else None
    ctx = loop.LoopContext(
        cfg=cfg, layout=job.the_layout(), engine=engine, data=open_tokens(job.data_dir),
        tracker=tracker, ckpt=CheckpointDir(_ckpt_dir(job, world), cfg.train.keep_ckpts),
        flops_per_token=flops_per_token(cfg.model), peak_flops_per_device=peak_flops(cfg),
        world_size=job.world_size, on_step=bar.on_step if bar else None)
    try:
        last = loop.train(ctx)
    except BaseException:
        tracker.close("FAILED" if not isinstance(sys.exc_info()[1], KeyboardInterrupt)
                      else "KILLED")
        raise
    finally:
        if bar:
            bar.close()
    # A run stopped for a requeue stays RUNNING: its next attempt continues the same MLflow run.
    tracker.close("RUNNING" if "stopped_at" in last else "FINISHED")
    return last


def _ckpt_dir(job: Job, world: Dict[str, int]) -> str:
    base = os.path.join(job.run_dir, "checkpoints")
    return base if job.world_size == 1 else os.path.join(base, f"rank{world['rank']:05d}")


class _progress:
    """A tqdm bar with loss and tokens/s (stderr, so stdout stays machine-readable)."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr,
                        dynamic_ncols=True, mininterval=0.5)

    def on_step(self, step: int, m: Dict[str, float]) -> None:
        if self.bar.n == 0 and step > 0:
            self.bar.update(step)
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


@guarded
def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m workbench.train JOB_FILE", file=sys.stderr)
        return 2
    run_job(Job.load(argv[0]))
    return 0


def entry(argv: Optional[List[str]] = None) -> None:
    sys.exit(main(sys.argv[1:] if argv is None else argv))
