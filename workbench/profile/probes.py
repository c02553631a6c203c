"""What the engine itself costs beyond the operations it runs: one training micro-batch of the
real engine (parallelize, its hooks, DTensor, FSDP2, the loss's collectives) for each kind of
parallelism at each degree, on models of one layer and of three.

The GEMM, block and collective curves price what a layer computes and sends; a CPU run also
pays, per layer and per micro-batch, for what the engine does around them (Python hooks,
DTensor dispatch, FSDP2's copies, autograd's graph). Half their difference is one layer as the
engine runs it, which the cost model compares with its own price of the same
probe (workbench.plan.cost.engine_residuals). After each step the engine's optimizer step is
timed too, as the loop runs it (gradient clipping over the engine's shards, AdamW over its
parameters, gradients set to None): over DTensors it costs a multiple of the plain model's
update the compute tables time, and the loop's next backward allocates fresh gradients, as the
probe's then does.

Each degree k is probed by k ranks of the job in a process group of their own (the job's ranks
beyond k wait), so that as many ranks compute as a run of k ranks would; on a CPU, where ranks
share a host's cores, it is probed again with every rank of the job busy (world/k groups of k
at once; where the ranks outnumber the cores, the other groups compute a block over and over
while rank 0's group probes), as a larger layout runs its k-rank groups side by side: how
much of the engine's cost grows when the cores are shared is measured, not assumed. From
degree 4 two kinds are also probed composed (replication or sharding over 2 beside TP, CP or
sharding over the rest): the engine then runs FSDP2 over the other kind's DTensors, a cost
neither single probe has.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from workbench.config import ModelConfig, RunConfig, compute_dtype
from workbench.layout import Layout
from workbench.plan.cost.engine_residuals import COMPOSED, PROBES
from workbench.profile.compute import block_ops, keep_busy
from workbench.profile.rank import oversubscribed
from workbench.train.engine.mesh_engine import make_engine
from workbench.train.model import build
from workbench.train.optimizer import make_optimizer, update
from workbench.train.parallel import comm

Progress = Callable[[str], None]
LAYERS = (1, 3)  # the probed models' layer counts: their difference is two layers


def kinds(degree: int, model: ModelConfig) -> Dict[str, Layout]:
    """The probed layouts of one degree, from the cost model's table of probe kinds (PROBES,
    which prices the same layouts): at degree 1 the plain and recomputed model, above it each
    kind of parallelism alone, and from degree 4 two composed; those the model's heads and
    sequence divide (a layout's micro-batch is set per probe)."""
    out = {}
    for name, at in PROBES.items():
        layout = at(degree)
        if (degree == 1) != (name in ("plain", "recompute")) or layout.world_size != degree \
                or (name in COMPOSED and degree < 4):
            continue
        if model.n_heads % layout.tp or model.n_kv_heads % layout.tp \
                or model.seq_len % (2 * layout.cp):
            continue
        out[name] = layout
    return out


def _batch(model: ModelConfig, micro_batch: int, device: torch.device) -> list:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab, (micro_batch, model.seq_len + 1), generator=gen)
    return [(tokens[:, :-1].to(device), tokens[:, 1:].to(device))]


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe_degree(cfg: RunConfig, model: ModelConfig, degree: int, rank: int,
                 micro_batches: List[int], device: torch.device, show: Progress,
                 busy: int, reps: int = 7) -> List[Dict[str, Any]]:
    """Every kind of this degree, on models of 1 and 3 layers, at every micro-batch: the two
    (each step, then its optimizer step) and the reference timed in turn, `reps` times each
    (so a slow spell of the machine falls on all three), medians."""
    rows = []
    dtype = compute_dtype(cfg.train, cfg.cluster)
    for kind, layout in kinds(degree, model).items():
        show(f"engine probes: {model.name} {kind} x{degree}, {busy} ranks busy")
        engines = {}
        for layers in LAYERS:
            one = replace(model, n_layers=layers)
            engine = make_engine(build(one, cfg.train.seed), replace(cfg, model=one), layout,
                                 rank, device, comm.ByteCounter())
            engines[layers] = (one, engine, _optimizer_step(engine, cfg, device))
        steps: Dict[Any, Callable[[], object]] = {}
        for mb in micro_batches:
            tokens = mb * model.seq_len // layout.cp
            steps = {
                n: (lambda e=engine, b=_batch(one, mb, device): e.train_step(b))
                for n, (one, engine, _) in engines.items()}
            steps["ref"] = block_ops(model, layout.tp, tokens, dtype, device)["both"]
            times: Dict[Any, List[float]] = defaultdict(list)
            for _ in range(reps + 1):  # the first round warms up
                for n, fn in steps.items():
                    times[n].append(_timed(fn))
                    if n in engines:
                        times[("opt", n)].append(_timed(engines[n][2]))
            for n in LAYERS:
                rows.append({"model": model.name, "kind": kind, "degree": degree,
                             "busy": busy, "layers": n, "micro_batch": mb, "tokens": tokens,
                             "step_s": statistics.median(times[n][1:]),
                             "ref_s": statistics.median(times["ref"][1:]),
                             "opt_s": statistics.median(times[("opt", n)][1:]), "dtype": dtype})
        # gone while their process group lives: a parallelized model holds the group in
        # reference cycles, and one collected after the group's end (or at the interpreter's)
        # aborted a rank now and then ("terminate called without an active exception")
        engines.clear()
        steps.clear()
        gc.collect()
    return rows


def _optimizer_step(engine: Any, cfg: RunConfig, device: torch.device) -> Callable[[], None]:
    """The loop's update after a step (optimizer.update), AdamW as training builds it over the
    engine's parameters."""
    opt = make_optimizer(list(engine.view.parameters()), cfg, fused=device.type == "cuda")
    return lambda: update(engine, opt, cfg.train.grad_clip)


def busy_counts(degree: int, world: int, device: torch.device) -> List[int]:
    """How many of the job's ranks run a degree's probes at once: the degree alone, and on a
    CPU (whose cores the ranks share) twice, four times ... as many, up to the whole job."""
    if device.type != "cpu":
        return [degree]
    out, busy = [], degree
    while busy < world:
        out.append(busy)
        busy *= 2
    return out + [world]


def run_probes(cfg: RunConfig, models: List[ModelConfig], degrees: List[int],
               micro_batches: List[int], rank: int, world: int, folder: Path,
               threads: Callable[[int], int], device: torch.device, show: Progress
               ) -> List[Dict[str, Any]]:
    """The probes of every degree and count of busy ranks in turn, each group of `degree`
    ranks in a process group of its own (the default group of the job must be gone); rank 0
    returns its group's rows."""
    rows: List[Dict[str, Any]] = []
    stages = [(d, b) for d in degrees for b in busy_counts(d, world, device)]
    for stage, (degree, busy) in enumerate(stages):
        group, local = divmod(rank, degree)
        done0 = folder / f"probes_{stage}_0.done"
        if 0 < group and rank < busy and oversubscribed(busy, device):
            # the other groups of a busy stage keep their cores busy while rank 0's group
            # probes (only its rows are kept): alike at every moment of its timings
            keep_busy(models[0], compute_dtype(cfg.train, cfg.cluster), device, threads(busy),
                      done0.exists)
            (folder / f"probes_{stage}_{group}.done").write_text("done")
        elif rank < busy:
            if device.type == "cpu":
                torch.set_num_threads(threads(busy))
            # a file in the job's folder (which every rank shares already), not a port: a free
            # port at the launch may be taken by the time a later stage binds it
            store = None if degree == 1 else dist.FileStore(
                str(folder / f"probes_{stage}_{group}.store"), degree)
            with comm.process_group(device.type, local, degree, comm.ByteCounter(),
                                    store=store):
                for model in models:
                    rows += probe_degree(cfg, model, degree, local, micro_batches, device,
                                         show if rank == 0 else _quiet, busy)
            del store
            gc.collect()
            if local == 0:
                (folder / f"probes_{stage}_{group}.done").write_text("done")
        # every group done before the next stage: the ranks beyond the busy ones idle
        while not all((folder / f"probes_{stage}_{g}.done").exists()
                      for g in range(busy // degree)):
            time.sleep(0.2)
    return rows if rank == 0 else []


def _quiet(what: str) -> None:
    """Progress of a group other than rank 0's: shown once, by rank 0's."""
