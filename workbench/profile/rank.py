"""What every rank of a profile job does: say where it runs, time its device at every number of
ranks that can share its host, time the collectives over every group, and (rank 0) check a
training step's memory. Rank 0 returns everything as plain data.

Compute is timed at each count of ranks busy on one host (1, 2, 4, ... up to the job's): on a
CPU the ranks of a job share the cores, so a run of 4 ranks computes at another speed per rank
than a run of 1, and the profile must hold the speed the run will see, not the machine alone.
"""

from __future__ import annotations

import datetime
import os
import resource
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from workbench.config import ModelConfig, RunConfig, compute_dtype
from workbench.plan.cost.shapes import block_key, model_shape
from workbench.profile import comms
from workbench.profile import compute as cm
from workbench.profile.spec import ProfileSpec
from workbench.profile.timing import Timing, interleaved_medians

Progress = Callable[[str], None]


def where() -> Dict[str, Any]:
    """This rank's host (a physical machine: its cores are shared), its node (a network
    endpoint: a host, or a network namespace on one) and its device. The host is the running
    kernel's boot id, not the host name: the nodes of the local multi-node cluster
    (slurm/nodes.sh) have host names of their own but share this machine's cores."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    host = boot.read_text().strip() if boot.exists() else socket.gethostname()
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return {"host": host, "node": f"{host}/{net}", "device_name": device_name()}


def device_name() -> str:
    """The GPU's name, or the CPU's model name: what a profile is valid for."""
    if torch.cuda.is_available() and os.environ.get("WORKBENCH_PROFILE_DEVICE", "") != "cpu":
        return torch.cuda.get_device_name(0)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() \
            else []:
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def levels(ranks_on_host: int, device: torch.device) -> List[int]:
    """How many ranks of a host compute at once in the runs this profile prices: 1, 2, 4, ...
    and the job's own count. A GPU is its rank's own: one level, every GPU busy."""
    if device.type == "cuda":
        return [ranks_on_host]
    out, k = [], 1
    while k < ranks_on_host:
        out.append(k)
        k *= 2
    return out + [ranks_on_host]


def oversubscribed(ranks: int, device: torch.device) -> bool:
    """More ranks than cores on a CPU host. There, when each rank timed for itself, the ranks
    drifted apart and what shared a core during a timing (a long GEMM, a tiny op, a rank
    already waiting) was chance: two profiles' tables of 4 ranks on 2 cores differed point by
    point by up to 7x. So one rank times and the others compute as a run's ranks do
    (`compute.keep_busy`). Where every rank has a core, ranks timing side by side repeat
    better. Two profiles' prices (benchmarks/profile_repeatability.py, median spread):
    everyone timing 5.3% (4 ranks 11.6%, 2 ranks 3.8%); kept busy at every level 6.3% (4 ranks
    5.2%, 2 ranks 10.8%); kept busy only here 5.0% (4 ranks 7.8%, 2 ranks 4.2%)."""
    return device.type == "cpu" and ranks > cores()


def threads_for(ranks: int) -> int:
    """The intra-op threads a rank gets when `ranks` share the host (what the launchers give)."""
    return max(1, cores() // ranks)


def compute_level(spec: ProfileSpec, cfg: RunConfig, device: torch.device, ranks: int,
                  show: Progress) -> Dict[str, Any]:
    """Every compute table at one count of busy ranks per host."""
    threads = threads_for(ranks) if device.type == "cpu" else 0
    timing = Timing(spec.trial_s, spec.trials)
    if threads:
        torch.set_num_threads(threads)
    models = [ModelConfig(**m) for m in spec.models]
    level: Dict[str, Any] = {"ranks": ranks, "threads": threads, "gemm": [], "blocks": [],
                             "optimizer": [],
                             "elementwise": cm.elementwise_curve(device, spec.elementwise_bytes,
                                                            timing)}
    for dtype in spec.dtypes:
        shapes = sorted({g for m in models for g in gemm_shapes(m, spec.tps)},
                        key=lambda g: (g.k, g.n))
        rows = {"dtype": dtype, "k": [], "n": [], "tokens": [], "fwd_s": [], "bwd_s": []}
        for i, shape in enumerate(shapes):
            show(f"compute x{ranks}: {dtype} GEMM {shape.k}x{shape.n} ({i + 1}/{len(shapes)})")
            ops = {(tok, part): fn for tok in spec.tokens
                   for part, fn in cm.gemm_ops(shape, tok, dtype, device).items()}
            times = interleaved_medians(ops, device, timing)
            for tok in spec.tokens:
                for key, v in zip(("k", "n", "tokens", "fwd_s", "bwd_s"),
                                  (shape.k, shape.n, tok, times[(tok, "fwd")],
                                   times[(tok, "bwd")])):
                    rows[key].append(v)
        level["gemm"].append(rows)
        for m in models:
            level["blocks"].append(_block_table(m, spec, dtype, device, ranks, show))
    for m in models:
        show(f"compute x{ranks}: {m.name} optimizer step")
        level["optimizer"].append({"model": m.name, **cm.optimizer_times(
            _with_model(cfg, m), device, timing)})
    return level


def _with_model(cfg: RunConfig, model: ModelConfig) -> RunConfig:
    return replace(cfg, model=model)


def gemm_shapes(model: ModelConfig, tps: List[int]) -> List[cm.Gemm]:
    """Every linear of a block and the LM head as a rank holds it at each TP degree."""
    ms = model_shape(model)
    linears = list(ms.dense) + [(ms.hidden, ms.vocab, True)]
    out = []
    for tp in tps:
        for m, n, col in linears:
            if (n if col else m) % tp == 0:
                out.append(cm.Gemm(m, n // tp) if col else cm.Gemm(m // tp, n))
    return out


def _block_table(model: ModelConfig, spec: ProfileSpec, dtype: str, device: torch.device,
                 ranks: int, show: Progress) -> Dict[str, Any]:
    timing = Timing(spec.trial_s, spec.trials)
    rows: Dict[str, Any] = {"model": model.name, "shape": block_key(model_shape(model)),
                            "dtype": dtype, "tp": [], "tokens": [], "fwd_s": [], "bwd_s": [],
                            "loss_fwd_s": [], "loss_bwd_s": []}
    for tp in (t for t in spec.tps if model.n_heads % t == 0 and model.n_kv_heads % t == 0):
        show(f"compute x{ranks}: {dtype} {model.name} block, tp {tp}")
        ops = {(what, tok, part): fn for tok in spec.tokens
               for what, made in (("block", cm.block_ops(model, tp, tok, dtype, device)),
                                  ("loss", cm.loss_ops(model, tp, tok, dtype, device)))
               for part, fn in made.items()}
        t = interleaved_medians(ops, device, timing)
        for tok in spec.tokens:
            values = (tp, tok, t[("block", tok, "fwd")],
                      max(0.0, t[("block", tok, "both")] - t[("block", tok, "fwd")]),
                      t[("loss", tok, "fwd")],
                      max(0.0, t[("loss", tok, "both")] - t[("loss", tok, "fwd")]))
            for key, v in zip(("tp", "tokens", "fwd_s", "bwd_s", "loss_fwd_s", "loss_bwd_s"),
                              values):
                rows[key].append(v)
    return rows


def memory_check(cfg: RunConfig, device: torch.device) -> Dict[str, Any]:
    """The memory a process holds before any model (the allowance the memory model adds to
    every rank) and its peak over one training step of the first model at micro-batch 1, so
    the memory model can be checked against a step. First thing on rank 0: later timings
    allocate tensors that would raise the peak."""
    baseline = _held_bytes(device)
    model = cm.build(cfg.model, cfg.train.seed, device)
    opt = cm.make_optimizer(list(model.parameters()), cfg, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.model.vocab, (1, cfg.model.seq_len + 1), device=device)
    with cm.autocast(device, compute_dtype(cfg.train, cfg.cluster)):
        loss = cm.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    return {"model": cfg.model.name, "micro_batch": 1, "baseline_bytes": baseline,
            "step_peak_bytes": _peak_bytes(device)}


def _held_bytes(device: torch.device) -> float:
    """What the process holds now: a GPU's memory in use (the CUDA context, the libraries'
    workspaces), or the process's peak resident memory on a CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free)
    return _peak_bytes(device)


def _peak_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def run(spec: ProfileSpec, cfg: RunConfig, rank: int, world: int, show: Progress,
        folder: Path) -> Optional[Dict[str, Any]]:
    """Every measurement, in order; rank 0 returns them (the others None). With several
    ranks the default process group exists already (the caller makes and ends it); `folder`
    is the job's, which every rank shares (rank 0 releases the busy ranks through it)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.device == "cuda" \
        else torch.device("cpu")
    me = where()
    everyone = _gather(me, world)
    hosts = [e["host"] for e in everyone]
    nodes = list(dict.fromkeys(e["node"] for e in everyone))
    node_of = [nodes.index(e["node"]) for e in everyone]
    on_host = hosts.count(me["host"])
    host_index = [r for r in range(world) if hosts[r] == me["host"]].index(rank)
    out: Dict[str, Any] = {"measured": {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "torch": torch.__version__, "device_type": device.type,
        "device_name": me["device_name"], "world": world, "nodes": len(nodes),
        "hosts": len(set(hosts)), "cores_per_host": cores() if device.type == "cpu" else 0,
        "ranks_per_host": on_host}, "compute": [], "comms": []}
    if rank == 0:
        show("memory: one training step")
        out["memory"] = memory_check(cfg, device)
    rounds: List[List[Any]] = []
    beside = [r for r in range(world) if hosts[r] == hosts[0]][1:]  # rank 0's host's others
    for round_ in range(spec.rounds):  # the whole sweep again: a slow spell falls on one round
        rounds.append([])
        for ranks in levels(on_host, device):
            level = None
            # a file, not a gloo message: gloo's irecv is complete only once waited on
            released = folder / f"compute_{round_}_{ranks}.done"
            if rank == 0 or (host_index < ranks and not oversubscribed(ranks, device)):
                level = compute_level(spec, cfg, device, ranks, show)
                if rank == 0:
                    released.write_text("done")
            elif oversubscribed(ranks, device) and rank in beside[:ranks - 1]:
                cm.keep_busy(ModelConfig(**spec.models[0]), spec.dtypes[0], device,
                             threads_for(ranks), released.exists)
            _barrier(world)
            rounds[-1].append(level)
    if rank == 0:
        out["compute"] = [least_of_rounds(list(same)) for same in zip(*rounds)]
    if world > 1:
        torch.set_num_threads(threads_for(on_host)) if device.type == "cpu" else None
        out["comms"] = collectives(spec, device, node_of, show)
    return out if rank == 0 else None


def least_of_rounds(levels: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One level from the same level measured in several rounds: every timing the least of its
    rounds (the rounds measure the same shapes in the same order). Each round's figure is
    already a median over trials, so it keeps the typical jitter; a slow spell that outlasts a
    shape's trials (another process on a shared core stalls every call of a two-thread GEMM for
    a scheduler slice) only adds time, and falls on one round."""
    def merge(parts: List[Any]) -> Any:
        first = parts[0]
        if isinstance(first, dict):
            return {k: merge([p[k] for p in parts]) for k in first}
        if isinstance(first, list):
            return [merge(list(v)) for v in zip(*parts)]
        if isinstance(first, float):
            return min(parts)
        return first

    return merge(levels)


def collectives(spec: ProfileSpec, device: torch.device, node_of: List[int], show: Progress
                ) -> List[Dict[str, Any]]:
    parts = comms.partitions(node_of)
    groups = comms.make_groups(parts)
    out = []
    # every group of a size busy at once (a layout over the whole world), and one group alone
    # (a run of only its ranks): on shared cores the two differ
    variants = [q for p in parts for q in ([p, comms.alone(p)] if len(p.groups) > 1 else [p])]
    for part in variants:
        for kind in comms.KINDS:
            if kind == "p2p" and part.size != 2:
                continue
            busy = part.size * len(part.groups)
            show(f"collectives: {kind} over {len(part.groups)} group(s) of {part.size}, "
                 f"{part.span} node")
            t0 = time.perf_counter()
            rows = comms.curve(kind, part, spec.comm_bytes, device, groups, spec.slow_s,
                               spec.budget_s)
            out.append({"kind": kind, "group": part.size, "span": part.span, "ranks": busy,
                        "bytes": [r["bytes"] for r in rows], "s": [r["s"] for r in rows],
                        "measure_s": time.perf_counter() - t0})
    return out


def _gather(obj: Any, world: int) -> List[Any]:
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
