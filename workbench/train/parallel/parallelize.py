"""Apply a Layout to the full model, in a fixed order (as torchtitan does, written anew here):

1. split pipeline stages (pipeline.py), so each later step sees only this rank's modules;
2. context parallel: this rank's positions and the all-gather attention (context.py);
   then tensor parallel (+ sequence parallel) plans over the "tp" mesh dimension;
3. activation checkpointing (recompute) per block, then
4. torch.compile per block (train.compile), keeping parameter names (recompute.py: the same
   two steps the single-process engine applies);
5. data parallel last: FSDP2 `fully_shard` (HSDP when dp_replicate and dp_shard are both used,
   or when replication sits next to DTensor parameters), DDP when replication is all there is.

The model file knows nothing of this; every step works by module name.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.config import RunConfig, compute_dtype
from workbench.layout import Layout
from workbench.train.model import Transformer
from workbench.train.parallel.context import apply_cp
from workbench.train.parallel.mesh import Mesh, uses_ddp, uses_fsdp
from workbench.train.parallel.pipeline import split_stage, stage_ids
from workbench.train.parallel.recompute import apply_block_steps


def tp_plan(model: Transformer, sequence_parallel: bool) -> Dict[str, object]:
    """The tensor-parallel plan by module name for whatever part of the model is present.

    Attention heads and the FFN hidden dimension are split column-wise then row-wise (one
    all-reduce per sublayer). With sequence parallelism the norms and residual stream are
    sharded along the sequence (Shard(1)); the all-reduce becomes reduce-scatter + all-gather.
    The LM head gathers full logits so the loss is computed exactly as on one process."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    for name in model.layers.keys():
        p = f"layers.{name}"
        plan.update({f"{p}.attention.wq": ColwiseParallel(),
                     f"{p}.attention.wk": ColwiseParallel(),
                     f"{p}.attention.wv": ColwiseParallel(),
                     f"{p}.attention.wo": RowwiseParallel(output_layouts=seq),
                     f"{p}.feed_forward.w1": ColwiseParallel(),
                     f"{p}.feed_forward.w2": RowwiseParallel(output_layouts=seq)})
        if model.cfg.family == "llama":
            plan[f"{p}.feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan.update({
                f"{p}.attention_norm": SequenceParallel(),
                f"{p}.ffn_norm": SequenceParallel(),
                f"{p}.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                     desired_input_layouts=(Replicate(), None)),
                f"{p}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),))})
    return plan


def apply_tp(model: Transformer, mesh: Mesh, layout: Layout) -> None:
    if layout.tp > 1:
        from workbench.lowrank.factorize import adapt_tp_plan

        plan = adapt_tp_plan(model, tp_plan(model, layout.sequence_parallel),
                             layout.sequence_parallel)
        parallelize_module(model, mesh.sub("tp"), plan)


def apply_fsdp(model: Transformer, mesh: Mesh, layout: Layout, dtype: str,
               reshard_after_forward: bool) -> None:
    """FSDP2 per block, then the stage root; bf16 compute with fp32 reduction when asked."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh.fsdp
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


# DDP's bucket cap when one bucket is wanted: larger than any model's gradients.
ONE_BUCKET_MB = 1 << 20


def ddp_bucket_cap_mb(cfg: RunConfig, device: torch.device) -> Optional[float]:
    """None (DDP's default 25 MB buckets), or one bucket for PowerSGD on CPU ranks
    (lowrank.powersgd_one_bucket, on by default; GPU ranks keep DDP's buckets).

    Why: PowerSGD's hook waits for each bucket's collectives before it returns (three in a row:
    the uncompressed tensors, P, Q; lowrank/powersgd.py says why it must), so every bucket is a
    point inside the backward where each rank stops until the other ranks arrive. Ranks that
    share cores with each other and with other jobs drift apart between such points, and each
    one costs the drift (a 4 KB all-reduce: ~0.8 ms back to back, ~3.6 ms after 20 ms of compute
    on each of 2 ranks on 2 shared cores; benchmarks/lowrank_sync_probe.py). With one bucket the
    hook runs once, after the backward, and its three collectives follow each other with only
    the compression between them: gpt_small's 13 collectives a step become 4. Measured at 2
    ranks, that is a wash on a quiet machine (the hook computes ~0.04 s more in one bucket) and
    13% faster with other jobs on the cores; the ranks meet once a step, as in the other modes.
    On CPU ranks the all-reduce hides nothing behind the backward (dp_scaling.GLOO_CPU_OVERLAP),
    so no overlap is lost. On GPUs the wait is a stream dependency, not a stop of the host, and
    DDP's buckets let PowerSGD's collectives overlap the rest of the backward: they are kept."""
    one = (cfg.lowrank.mode == "powersgd" and cfg.lowrank.powersgd_one_bucket
           and device.type == "cpu")
    return float(ONE_BUCKET_MB) if one else None


def apply_ddp(model: nn.Module, mesh: Mesh, device: torch.device,
              bucket_cap_mb: Optional[float] = None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    # Buffers (RoPE tables, positions, a CP rank's mask) are built alike on every rank of the
    # group, so DDP need not re-broadcast them each forward. torch 2.13 renamed the switch and
    # warns on every rank under the old name.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        kw["forward_sync_buffers"] = False
    else:
        kw["broadcast_buffers"] = False
    return DistributedDataParallel(model, device_ids=ids,
                                   process_group=mesh.group("dp_replicate"), **kw)


def parallelize(model: Transformer, mesh: Mesh, layout: Layout, cfg: RunConfig,
                device: torch.device) -> List[nn.Module]:
    """This rank's modules, in stage order (one unless pipelined with virtual stages), each
    with TP, recompute, compile and data parallelism applied. DDP-wrapped modules come back
    wrapped; their `.module` is the stage."""
    if layout.pp > 1:
        split = list(layout.stage_split(model.cfg.n_layers))
        parts = [split_stage(model, s, split) for s in stage_ids(layout, mesh.pp_rank)]
    else:
        parts = [model]
    out: List[nn.Module] = []
    for part in parts:
        part.to(device)
        if layout.cp > 1:
            apply_cp(part, mesh.group("cp"), layout.cp, mesh.coord("cp"))
        apply_tp(part, mesh, layout)
        apply_block_steps(part, layout.recompute, cfg.train.compile)
        if uses_fsdp(layout):
            # Inside a pipeline, parameters stay gathered between micro-batches.
            apply_fsdp(part, mesh, layout, compute_dtype(cfg.train, cfg.cluster),
                       reshard_after_forward=layout.pp == 1)
            out.append(part)
        elif uses_ddp(layout):
            out.append(apply_ddp(part, mesh, device, ddp_bucket_cap_mb(cfg, device)))
        else:
            out.append(part)
    return out
