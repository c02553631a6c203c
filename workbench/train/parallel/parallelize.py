"""Apply a Layout to the full model, in a fixed order (as torchtitan does, written anew here):

1. split pipeline stages (pipeline.py), so each later step sees only this rank's modules;
2. context parallel: this rank's positions and the all-gather attention (context.py);
   then tensor parallel (+ sequence parallel) plans over the "tp" mesh dimension;
3. activation checkpointing (recompute) per block, then
4. torch.compile per block (train.compile), keeping parameter names (recompute.py);
5. data parallel last (`DataParallel`): FSDP2 `fully_shard` (HSDP when dp_replicate and
   dp_shard are both used, or when replication sits next to DTensor parameters), composable
   `replicate` when replication is all there is, nothing at one data-parallel rank.

Every step changes the modules in place and skips itself at degree 1, so a world of one rank
runs the same function. The model file knows nothing of this; every step works by module name,
and a module that brings its own tensor-parallel plan (a factorized linear) is asked for it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
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


def adapt_tp_plan(model: nn.Module, plan: Dict[str, object],
                  sequence_parallel: bool) -> Dict[str, object]:
    """The plan with every entry whose module has a `tp_plan(style, sequence_parallel)` method
    (a low-rank factorized linear, say) replaced by the plan that module gives for its own
    submodules: the layer that replaced a dense linear knows how to shard like it, and this
    file need not know what replaced it."""
    out: Dict[str, object] = {}
    for name, style in plan.items():
        own = getattr(model.get_submodule(name), "tp_plan", None)
        if own is None:
            out[name] = style
        else:
            out.update({f"{name}.{k}": v for k, v in own(style, sequence_parallel).items()})
    return out


def apply_tp(model: Transformer, mesh: Mesh, layout: Layout) -> None:
    if layout.tp > 1:
        plan = adapt_tp_plan(model, tp_plan(model, layout.sequence_parallel),
                             layout.sequence_parallel)
        parallelize_module(model, mesh.sub("tp"), plan)


# The bucket cap when one bucket is wanted: larger than any model's gradients.
ONE_BUCKET_MB = 1 << 20


def ddp_bucket_cap_mb(cfg: RunConfig, device: torch.device) -> Optional[float]:
    """None (DDP's default 25 MB buckets), or one bucket for PowerSGD on CPU ranks
    (lowrank.powersgd_one_bucket, on by default; GPU ranks keep DDP's buckets).

    Why: PowerSGD's hook waits for each bucket's collectives before it returns
    (lowrank/powersgd.py says why it must), so every bucket is a point inside the backward
    where each rank stops until the others arrive, and ranks that share cores drift apart
    between such points. With one bucket the hook runs once, after the backward, and its three
    collectives follow each other with only the compression between them. On CPU ranks the
    all-reduce hides nothing behind the backward, so no overlap is lost; on GPUs the wait is a
    stream dependency, and DDP's buckets let the collectives overlap the backward: kept.
    The README's low-rank section gives what this measured."""
    one = (cfg.lowrank.mode == "powersgd" and cfg.lowrank.powersgd_one_bucket
           and device.type == "cpu")
    return float(ONE_BUCKET_MB) if one else None


class DataParallel:
    """How this rank's gradients meet the other data-parallel ranks': chosen once per layout
    (`data_parallel`), applied to every part on every (re)build. The base class is one
    data-parallel rank: nothing to apply, nothing to sync."""

    group: Optional[Any] = None  # replication's process group (comm hooks run over it)

    def apply(self, part: nn.Module) -> None:
        pass

    def set_sync(self, part: nn.Module, sync: bool) -> None:
        """Whether the coming backward reduces gradients across ranks (the last micro-batch
        does; the others accumulate locally)."""

    def register_comm_hook(self, part: nn.Module, make_state: Callable[[nn.Module, Any], Any],
                           hook: Callable) -> Optional[Any]:
        """A DDP comm hook on `part`, with the state `make_state(part, group)` builds; None
        where nothing replicates gradients through DDP's reducer."""
        return None


class Replicated(DataParallel):
    """torch.distributed's composable `replicate`: DDP's reducer and comm hooks, with the
    module kept in place (no wrapper to unwrap)."""

    def __init__(self, mesh: Mesh, device: torch.device, bucket_cap_mb: Optional[float]):
        self.group, self.device = mesh.group("dp_replicate"), device
        self.kwargs: Dict[str, Any] = {} if bucket_cap_mb is None else {
            "bucket_cap_mb": bucket_cap_mb}

    def apply(self, part: nn.Module) -> None:
        # Every rank builds the same seeded weights (and loads the same checkpoint), so the
        # start-up broadcast of DDP's init_sync would send what is already there.
        replicate(part, device_id=self.device, process_group=self.group, init_sync=False,
                  **self.kwargs)

    def set_sync(self, part: nn.Module, sync: bool) -> None:
        part.set_requires_gradient_sync(sync)

    def register_comm_hook(self, part: nn.Module, make_state: Callable[[nn.Module, Any], Any],
                           hook: Callable) -> Optional[Any]:
        # replicate() builds its reducer at the first forward and registers the hook then:
        # one registered after that forward would never run.
        state = make_state(part, self.group)
        part.register_comm_hook(state, hook)
        return state


class Sharded(DataParallel):
    """FSDP2 per block, then the part's root; bf16 compute with fp32 reduction when asked.
    Inside a pipeline, parameters stay gathered between micro-batches."""

    def __init__(self, mesh: Mesh, layout: Layout, dtype: str):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.mesh = mesh.fsdp
        self.mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if dtype == "bf16" else MixedPrecisionPolicy()
        self.reshard = layout.pp == 1

    def apply(self, part: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in part.layers.values():
            fully_shard(block, mesh=self.mesh, mp_policy=self.mp,
                        reshard_after_forward=self.reshard)
        fully_shard(part, mesh=self.mesh, mp_policy=self.mp, reshard_after_forward=self.reshard)

    def set_sync(self, part: nn.Module, sync: bool) -> None:
        # reduce-scatter every micro-batch (no unsharded gradient outlives its block: the
        # memory FSDP is chosen for); the HSDP all-reduce on the last one only
        part.set_requires_all_reduce(sync)


def data_parallel(layout: Layout, mesh: Mesh, cfg: RunConfig,
                  device: torch.device) -> DataParallel:
    if uses_fsdp(layout):
        return Sharded(mesh, layout, compute_dtype(cfg.train, cfg.cluster))
    if uses_ddp(layout):
        return Replicated(mesh, device, ddp_bucket_cap_mb(cfg, device))
    return DataParallel()


def parallelize(model: Transformer, mesh: Mesh, layout: Layout, cfg: RunConfig,
                device: torch.device, dp: DataParallel) -> List[nn.Module]:
    """This rank's modules, in stage order (one unless pipelined with virtual stages), each
    with TP, recompute, compile and data parallelism applied in place."""
    if layout.pp > 1:
        split = list(layout.stage_split(model.cfg.n_layers))
        parts = [split_stage(model, s, split) for s in stage_ids(layout, mesh.pp_rank)]
    else:
        parts = [model]
    for part in parts:
        part.to(device)
        if layout.cp > 1:
            apply_cp(part, mesh.group("cp"), layout.cp, mesh.coord("cp"))
        apply_tp(part, mesh, layout)
        apply_block_steps(part, layout.recompute, cfg.train.compile)
        dp.apply(part)
    return parts
