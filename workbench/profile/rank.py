"""What every rank of a profile job does: say where it runs, time its device at every number of
ranks that can share its host, time the collectives over every group, and (rank 0) check a
training step's memory. Rank 0 returns everything as plain data.

Compute is timed at each count of ranks busy on one host (1, 2, 4, ... up to the job's): on a
CPU the ranks of a job share the cores, so a run of 4 ranks computes at another speed per rank
than a run of 1, and the profile must hold the speed the run will see, not the machine alone.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from workbench.config import ModelConfig, RunConfig
from workbench.plan.cost.shapes import block_key, model_shape
from workbench.profile import compute as cm
from workbench.profile.spec import ProfileSpec

Progress = Callable[[str], None]


def where() -> Dict[str, Any]:
    """This rank's host (a physical machine: its cores are shared), its node (a network
    endpoint: a host, or a network namespace on one) and its device."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    host = socket.gethostname() + ":" + (boot.read_text().strip() if boot.exists() else "")
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


def threads_for(ranks: int) -> int:
    """The intra-op threads a rank gets when `ranks` share the host (what the launchers give)."""
    return max(1, cores() // ranks)


def compute_level(spec: ProfileSpec, cfg: RunConfig, device: torch.device, ranks: int,
                  show: Progress) -> Dict[str, Any]:
    """Every compute table at one count of busy ranks per host."""
    threads = threads_for(ranks) if device.type == "cpu" else 0
    if threads:
        torch.set_num_threads(threads)
    models = [ModelConfig(**m) for m in spec.models]
    level: Dict[str, Any] = {"ranks": ranks, "threads": threads, "gemm": [], "blocks": [],
                             "optimizer": [],
                             "elementwise": cm.elementwise_curve(device, spec.elementwise_bytes)}
    for dtype in spec.dtypes:
        shapes = sorted({g for m in models for g in gemm_shapes(m, spec.tps)},
                        key=lambda g: (g.k, g.n))
        rows = {"dtype": dtype, "k": [], "n": [], "tokens": [], "fwd_s": [], "bwd_s": []}
        for i, shape in enumerate(shapes):
            show(f"compute x{ranks}: {dtype} GEMM {shape.k}x{shape.n} ({i + 1}/{len(shapes)})")
            for tok in spec.tokens:
                fwd, bwd = cm.gemm_times(shape, tok, dtype, device)
                for key, v in zip(("k", "n", "tokens", "fwd_s", "bwd_s"),
                                  (shape.k, shape.n, tok, fwd, bwd)):
                    rows[key].append(v)
        level["gemm"].append(rows)
        for m in models:
            level["blocks"].append(_block_table(m, spec, dtype, device, ranks, show))
    for m in models:
        show(f"compute x{ranks}: {m.name} optimizer step")
        level["optimizer"].append({"model": m.name, **cm.optimizer_times(
            _with_model(cfg, m), device)})
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
    rows: Dict[str, Any] = {"model": model.name, "shape": block_key(model_shape(model)),
                            "dtype": dtype, "tp": [], "tokens": [], "fwd_s": [], "bwd_s": [],
                            "loss_fwd_s": [], "loss_bwd_s": []}
    for tp in (t for t in spec.tps if model.n_heads % t == 0 and model.n_kv_heads % t == 0):
        show(f"compute x{ranks}: {dtype} {model.name} block, tp {tp}")
        for tok in spec.tokens:
            fwd, bwd = cm.block_times(model, tp, tok, dtype, device)
            lf, lb = cm.loss_times(model, tp, tok, dtype, device)
            for key, v in zip(("tp", "tokens", "fwd_s", "bwd_s", "loss_fwd_s", "loss_bwd_s"),
                              (tp, tok, fwd, bwd, lf, lb)):
                rows[key].append(v)
    return rows
