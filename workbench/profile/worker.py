"""`python -m workbench.profile.worker JOB_FILE`: one rank of a profile job, started by any
launcher exactly as a training rank is (the job file's kind is `profile`)."""

from workbench.startup import fewer_gc_passes

fewer_gc_passes()  # before torch loads (workbench/startup.py)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workbench.cli import guarded  # noqa: E402
from workbench.job import FINAL_METRICS, Job  # noqa: E402
from workbench.profile import rank as profile_rank  # noqa: E402
from workbench.profile.job import RESULT  # noqa: E402
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
        out = profile_rank.run(spec, cfg, world["rank"], world["world_size"], show)
    finally:
        if world["world_size"] > 1:
            dist.destroy_process_group()
    if out is not None:
        _write(os.path.join(job.run_dir, RESULT), out)
        _write(os.path.join(job.run_dir, FINAL_METRICS), {"profile_s": time.perf_counter() - start})
    return {"profile_s": time.perf_counter() - start}


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
