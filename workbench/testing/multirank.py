"""Run many layouts inside a multi-process gloo group, for tests and the CPU benchmark.

torchrun pays 10-20 s to start a job; a layout case costs well under a second on gpt_tiny. So
this spawns N ranks once (torch.multiprocessing, a FileStore rendezvous, the same counting
backend and engine as a real run) and runs every case through the real training loop in them.
Results come back as plain JSON files, one per rank (tensors sent through a queue can vanish
when the child exits).

What a case leaves behind stays in its ranks: its mesh's gloo subgroups (each with its own
threads), and its model, held by torch's DTensor caches. A real run builds one engine per
process; here the 30th case of a group ran its layout 20-30% slower than the first (149
threads a rank, 49 groups). Timings therefore take `cases_per_group`: a fresh group of
processes every few cases (about 5 s each to start at 4 ranks).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from workbench.config import RunConfig
from workbench.data.corpus import TokenData
from workbench.layout import Layout
from workbench.rank import hooks_for
from workbench.track.tracker import NullTracker
from workbench.train import loop
from workbench.train.checkpoint.folder import CheckpointDir
from workbench.train.engine.bookkeeping import solo
from workbench.train.engine.mesh_engine import make_engine
from workbench.train.main import hook_context
from workbench.train.model import build, flops_per_token
from workbench.train.parallel import comm
from workbench.train.parallel.comm import ByteCounter


@dataclass
class Case:
    """One training run: `cfg` + `layout` for `cfg.train.steps` steps, checkpoints in ckpt_dir.
    `fingerprint` adds the sha256 of every full parameter after training (or after loading)."""

    name: str
    cfg: RunConfig
    layout: Layout
    ckpt_dir: str  # empty: no checkpoints
    fingerprint: bool = False
    train: bool = True  # False: only resume from ckpt_dir (then fingerprint)
    keep_up_to_step: Optional[int] = None  # first delete checkpoints after this step


class _NoCheckpoints:
    """For cases that only compare losses: the loop's final save would cost more than the
    steps."""

    def save(self, step: int, state: Dict[str, Any]) -> None:
        pass

    def load_latest(self, template=None) -> None:
        return None

    def steps(self) -> List[int]:
        return []

    def peek(self, key: str) -> None:  # low-rank hooks peek for their saved state
        return None


def weight_fingerprint(named: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """sha256 of each full tensor's bytes: equal fingerprints mean bitwise-equal weights."""
    return {k: hashlib.sha256(v.detach().float().contiguous().cpu().numpy().tobytes())
            .hexdigest() for k, v in named.items()}


def param_dtypes(engine: Any) -> List[str]:
    """The dtypes the engine keeps its parameters in (bf16 compute keeps fp32 masters)."""
    return sorted({str(p.dtype) for p in engine.view.parameters()})


def _record(history: List[Dict[str, float]]):
    def on_step(step: int, metrics: Dict[str, float]) -> None:
        history.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    return on_step


def median_after_first(history: List[Dict[str, float]], key: str) -> float:
    """A run's typical step: the median of `key` over every step but the first, which pays
    for warm-up (allocations, gloo's first connections)."""
    values = [h[key] for h in history[1:]] or [h[key] for h in history]
    return statistics.median(values)


def max_rel_loss_err(history: List[Dict[str, float]], ref_losses: List[float]) -> float:
    """The largest relative difference of a run's per-step losses from a reference run's: the
    parity figure the multi-rank benchmarks print and check."""
    return max(abs(h["loss"] - r) / abs(r) for h, r in zip(history, ref_losses))


def _context(cfg: RunConfig, layout: Layout, data: TokenData, engine: Any, ckpt: Any,
             world_size: int, history: List[Dict[str, float]]) -> loop.LoopContext:
    """A run's loop context as the rank entry builds it, with the hooks its config asks for,
    no tracking and every step's metrics recorded into `history`."""
    ctx = loop.LoopContext(cfg=cfg, layout=layout, engine=engine, data=data,
                           tracker=NullTracker(), ckpt=ckpt,
                           flops_per_token=flops_per_token(cfg.model),
                           peak_flops_per_device=cfg.cluster.peak_fp32_flops,
                           world_size=world_size, on_step=_record(history))
    ctx.hooks = hooks_for(hook_context(ctx, NullTracker(), ""))
    return ctx


def run_single(cfg: RunConfig, layout: Layout, data: TokenData, ckpt_dir: str,
               device: str = "cpu") -> Dict[str, Any]:
    """The reference: world size 1 through the same loop and engine, in this process (a
    process group of one rank for the duration); `device="cuda"` for a GPU's own step."""
    counter = ByteCounter()
    where = torch.device(device)
    with comm.process_group(where.type, 0, 1, counter):
        engine = make_engine(build(cfg.model, cfg.train.seed, where), cfg, layout, 0, where,
                             counter)
        history: List[Dict[str, float]] = []
        ctx = _context(cfg, layout, data, engine,
                       CheckpointDir(Path(ckpt_dir), engine.bookkeeping), 1, history)
        last = loop.train(ctx)
        return {"history": history, "last": last, "param_dtypes": param_dtypes(engine),
                "weights": weight_fingerprint(dict(engine.view.state_dict()))}


def _run_case(case: Case, data: TokenData, rank: int, world_size: int,
              counter: ByteCounter) -> Dict[str, Any]:
    cfg = case.cfg
    if case.keep_up_to_step is not None:  # as if the run had been killed after that step
        _drop_checkpoints_after(case.ckpt_dir, case.keep_up_to_step, rank)
    if cfg.train.threads:  # as the rank entry does (train/main.py); else the group's one
        torch.set_num_threads(cfg.train.threads)
    model = build(cfg.model, cfg.train.seed)
    engine = make_engine(model, cfg, case.layout, rank, torch.device("cpu"), counter)
    history: List[Dict[str, float]] = []
    ckpt = CheckpointDir(case.ckpt_dir, engine.bookkeeping, cfg.train.keep_ckpts) \
        if case.ckpt_dir else _NoCheckpoints()
    ctx = _context(cfg, case.layout, data, engine, ckpt, world_size, history)
    out: Dict[str, Any] = {"is_main": engine.is_main, "history": history,
                           "param_dtypes": param_dtypes(engine), "pid": os.getpid()}
    if case.train:
        out["last"] = {k: float(v) for k, v in loop.train(ctx).items()}
    else:
        out["resumed_at"] = loop.resume(ctx, loop.new_optimizer(ctx))
    if case.fingerprint:
        out["weights"] = weight_fingerprint(engine.full_state_dict())
    return out


def _drop_checkpoints_after(folder: str, step: int, rank: int) -> None:
    import shutil

    import torch.distributed as dist

    ckpt = CheckpointDir(folder, solo())  # only lists and deletes: no collective
    if rank == 0:
        for s in ckpt.steps():
            if s > step:
                shutil.rmtree(ckpt.path(s))
    dist.barrier()


def _child(rank: int, world_size: int, store_path: str, cases: List[Case], first: int,
           data: TokenData, out_dir: str, collective_timeout_s: float,
           netns: Optional[List[str]] = None, cgroups: Optional[List[str]] = None) -> None:
    import torch.distributed as dist

    from workbench.startup import fewer_gc_passes

    fewer_gc_passes()  # as a real rank does (workbench/train/__main__.py)

    if cgroups and cgroups[rank]:  # before torch starts its threads: they inherit the group
        from workbench.testing.cpuquota import join

        join(cgroups[rank])
    if netns:  # before gloo opens a socket or starts a thread: its traffic takes that NIC
        from workbench.testing.netns import IFNAME, enter_namespace

        enter_namespace(netns[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    torch.set_num_threads(1)
    counter = ByteCounter()
    # A short collective timeout turns a hang (a rank that failed alone) into an error.
    with comm.process_group("cpu", rank, world_size, counter, timeout_s=collective_timeout_s,
                            store=dist.FileStore(store_path, world_size)):
        for i, case in enumerate(cases, start=first):
            try:
                result = _run_case(case, data, rank, world_size, counter)
            except Exception as e:  # a failing case is reported, the group goes on
                result = {"error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()}
                dist.barrier()
            Path(out_dir, f"case{i:03d}_rank{rank}.json").write_text(json.dumps(result))
            # the case's engine, gone while its process group lives: a parallelized model holds
            # the group in reference cycles, and one collected after the group's end (or at the
            # interpreter's) aborted a rank now and then ("terminate called without an active
            # exception"), as the profiler's probes and the run's engine did before
            gc.collect()
    gc.collect()  # and the group's store, after its end


def run_cases(world_size: int, cases: List[Case], data: TokenData,
              workdir: Optional[str] = None, timeout_s: float = 600.0,
              collective_timeout_s: float = 120.0, netns: Optional[List[str]] = None,
              cgroups: Optional[List[str]] = None,
              cases_per_group: int = 0) -> List[Dict[str, Any]]:
    """Run the cases in spawned groups: one for them all, or with `cases_per_group` a fresh
    one for every that many (for timings, see the module's docstring). Per case: the main
    rank's result, with every rank's weight fingerprints merged (pipeline stages hold different
    parameters). The ranks are killed after timeout_s in all. `netns`: rank i runs in network
    namespace netns[i] (workbench.testing.netns.LimitedLink), so the ranks talk only over that
    link. `cgroups`: rank i runs in the cgroup at cgroups[i] ('' none;
    workbench.testing.cpuquota.CpuQuota)."""
    workdir = workdir or tempfile.mkdtemp(prefix="wb-multirank-")
    os.makedirs(workdir, exist_ok=True)
    per_group = cases_per_group or max(1, len(cases))
    deadline = time.monotonic() + timeout_s
    for first in range(0, len(cases), per_group):
        _spawn(world_size, cases[first:first + per_group], first, data, workdir, deadline,
               (collective_timeout_s, netns, cgroups))
    return [_merged(workdir, i, world_size) for i in range(len(cases))]


def _spawn(world_size: int, cases: List[Case], first: int, data: TokenData, workdir: str,
           deadline: float, options: tuple) -> None:
    """One group of ranks for `cases` (numbered from `first`), killed at the deadline."""
    import torch.multiprocessing as mp

    store_path = os.path.join(workdir, f"store{first:03d}")
    ctx = mp.spawn(_child, args=(world_size, store_path, cases, first, data, workdir,
                                 *options), nprocs=world_size, join=False)
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"{world_size} ranks did not finish cases {first}-"
                               f"{first + len(cases) - 1} in time")


def _merged(workdir: str, i: int, world_size: int) -> Dict[str, Any]:
    """Case i's result: its first error, or the main rank's with every rank's weights."""
    ranks = [json.loads(Path(workdir, f"case{i:03d}_rank{r}.json").read_text())
             for r in range(world_size)]
    errors = [r for r in ranks if "error" in r]
    if errors:
        return errors[0]
    main = next(r for r in ranks if r["is_main"])
    weights: Dict[str, str] = {}
    for r in ranks:
        weights.update(r.get("weights", {}))
    return {**main, "weights": weights, "ranks": ranks}
