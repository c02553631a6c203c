"""`python -m workbench.profile.worker JOB_FILE`: one rank of a profile job, started by any
launcher exactly as a training rank is (the job file's kind is `profile`)."""

from workbench.startup import fewer_gc_passes

fewer_gc_passes()  # before torch loads (workbench/startup.py)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workbench.cli import guarded  # noqa: E402
from workbench.config import ModelConfig  # noqa: E402
from workbench.job import FINAL_METRICS, Job  # noqa: E402
from workbench.plan.cost.shapes import block_key, model_shape  # noqa: E402
from workbench.profile import rank as profile_rank  # noqa: E402
from workbench.profile.job import RESULT  # noqa: E402
from workbench.profile.probes import run_probes  # noqa: E402
from workbench.profile.spec import ProfileSpec  # noqa: E402
from workbench.train.main import world_from_env  # noqa: E402
from workbench.train.parallel import comm  # noqa: E402


def run_job(job: Job, progress: bool = True,
            stop_requested: Optional[Callable[[], bool]] = None) -> Dict[str, float]:
    """Measure on this rank; rank 0 writes the profile into the job's folder. A profile is
    minutes long and has nothing to resume, so a stop request is not polled."""
    cfg, spec = job.run_config(), ProfileSpec(**job.task)
    world = world_from_env()
    start = time.perf_counter()

    def show(what: str) -> None:
        if progress and world["rank"] == 0:
            print(f"profile [{time.perf_counter() - start:5.0f} s] {what}", file=sys.stderr,
                  flush=True)

    if world["world_size"] > 1:
        if cfg.cluster.device == "cuda":
            torch.cuda.set_device(world["local_rank"])
        comm.init_process_group(cfg.cluster.device, world["rank"], world["world_size"],
                                comm.ByteCounter())
    try:
        out = profile_rank.run(spec, cfg, world["rank"], world["world_size"], show,
                               Path(job.run_dir))
    finally:
        if world["world_size"] > 1:
            dist.destroy_process_group()
    probes = run_probes(cfg, [ModelConfig(**m) for m in spec.models],
                        [d for d in profile_rank.levels(world["world_size"], torch.device("cpu"))
                         if world["world_size"] % d == 0], spec.probe_micro_batches,
                        world["rank"], world["world_size"], Path(job.run_dir),
                        profile_rank.threads_for, _device(cfg, world), show)
    if out is not None:
        out["probes"] = probe_tables(probes, spec)
        _write(os.path.join(job.run_dir, RESULT), out)
        _write(os.path.join(job.run_dir, FINAL_METRICS), {"profile_s": time.perf_counter() - start})
    return {"profile_s": time.perf_counter() - start}


def _device(cfg: Any, world: Dict[str, int]) -> torch.device:
    if cfg.cluster.device == "cuda":
        return torch.device("cuda", world["local_rank"])
    return torch.device("cpu")


def probe_tables(rows: List[Dict[str, Any]], spec: ProfileSpec) -> List[Dict[str, Any]]:
    """The probe rows as one column table per model."""
    out = []
    for m in spec.models:
        model = ModelConfig(**m)
        mine = [r for r in rows if r["model"] == model.name]
        table: Dict[str, Any] = {"model": model.name, "shape": block_key(model_shape(model))}
        for col in ("kind", "degree", "busy", "layers", "micro_batch", "tokens", "step_s",
                    "ref_s", "opt_s"):
            table[col] = [r[col] for r in mine]
        table["dtype"] = mine[0]["dtype"] if mine else ""
        out.append(table)
    return out


def _write(path: str, data: Dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


@guarded
def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m workbench.profile.worker JOB_FILE", file=sys.stderr)
        return 2
    run_job(Job.load(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
