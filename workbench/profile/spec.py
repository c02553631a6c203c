"""What a profile measures, decided by the driver from the models and the layouts they may run
in (no torch here: the driver of a torchrun or Slurm job never loads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from workbench.config import RunConfig

# Context-parallel degrees whose shorter per-rank sequences are timed.
MAX_CP = 4


@dataclass
class ProfileSpec:
    """The job file's task for every rank of a profile."""

    models: List[Dict[str, Any]]  # ModelConfig fields of each model
    dtypes: List[str]
    tps: List[int]  # tensor-parallel degrees whose per-rank shapes are timed
    tokens: List[int]  # tokens per micro-batch on one rank
    comm_bytes: List[int]
    elementwise_bytes: List[int] = field(default_factory=lambda: [2**k for k in range(12, 27, 2)])
    slow_s: float = 0.3  # a collective's curve stops after the first size slower than this
    budget_s: float = 0.2  # about this long timing one collective at one size
    trial_s: float = 0.01  # each compute timing: `trials` trials at least this long
    trials: int = 5
    probe_micro_batches: List[int] = field(default_factory=lambda: [1, 4, 16])
    rounds: int = 2  # compute tables measured this many times over, the least kept


def powers_of_two(low: int, high: int) -> List[int]:
    out, v = [], 1
    while v <= high:
        if v >= low:
            out.append(v)
        v *= 2
    return out


def spec_for(cfg: RunConfig, models: List[Dict[str, Any]], dtypes: List[str], max_tp: int,
             max_comm_bytes: int, quick: bool = False) -> ProfileSpec:
    """Token counts from a context-parallel shard of one sequence to the whole global batch on
    one rank; TP degrees that divide every model's heads up to `max_tp`; payloads from 4 KiB
    (latency) to `max_comm_bytes` (bandwidth), every factor of 4."""
    max_tp = max_tp or (8 if cfg.cluster.device == "cuda" else 4)
    seq = [m["seq_len"] for m in models]
    tokens = powers_of_two(max(1, min(seq) // MAX_CP), max(seq) * cfg.train.global_batch)
    tps = [t for t in powers_of_two(1, max_tp)
           if all(m["n_heads"] % t == 0 and m["n_kv_heads"] % t == 0 for m in models)]
    comm = [4096 * 4**i for i in range(16) if 4096 * 4**i <= max_comm_bytes]
    if quick:  # a smoke test's profile: every other token count, shorter and fewer trials
        tokens = sorted(set(tokens[::2] + tokens[-1:]))
        return ProfileSpec(models=models, dtypes=dtypes, tps=tps, tokens=tokens,
                           comm_bytes=comm[::2], slow_s=0.1, budget_s=0.05, trial_s=0.003,
                           trials=3, probe_micro_batches=[1, 4], rounds=1)
    return ProfileSpec(models=models, dtypes=dtypes, tps=tps, tokens=tokens, comm_bytes=comm)
