"""Pipeline parallelism: split the full model into stages, and run them with a
torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B).

Stages are cut from the full, seeded model by deleting what a stage does not own, so every
parameter keeps its global name (`layers.5.attention.wq.weight`) and checkpoints stay
layout-free. Rank r of the pp group owns stages r, r + pp, r + 2 pp, ... (the looped placement
interleaved 1F1B expects). Stages may hold different numbers of layers
(`layout.stage_layers`): the first and last stage lighter, or any list.

torch.distributed.pipelining is imported by make_schedule only: its import is a noticeable part
of a rank's start-up, and the ranks of a layout without a pipeline (most runs, and every rank of
a sweep's DDP trials) never use it.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from workbench.layout import Layout
from workbench.train.model import Transformer

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def stage_ids(layout: Layout, pp_rank: int) -> List[int]:
    """Global stage indices this pp rank owns, in execution order."""
    return [pp_rank + v * layout.pp for v in range(layout.virtual_stages)]


def split_stage(model: Transformer, stage: int, split: List[int]) -> Transformer:
    """A copy of the model that keeps only stage `stage`'s layers (`split`: layers of every
    global stage, in order), plus the embedding on the first stage, the final norm and head on
    the last; forward skips what is missing (a first or last stage may hold no layer)."""
    part = copy.deepcopy(model)
    n_stages, start = len(split), sum(split[:stage])
    keep = {str(i) for i in range(start, start + split[stage])}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage > 0:
        part.tok_embeddings = None
        part.pos_embeddings = None
    if stage < n_stages - 1:
        part.norm = None
        part.output = None
    return part


def make_schedule(stage_modules: List[nn.Module], stage_indices: List[int], layout: Layout,
                  device: torch.device, group, n_microbatches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """PipelineStage objects over the pp group and the layout's schedule. Gradients are scaled
    by 1 / n_microbatches (loss_fn is a per-micro-batch mean), as single-process accumulation."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n_stages = layout.pp * layout.virtual_stages
    stages = [PipelineStage(m, i, n_stages, device, group=group)
              for m, i in zip(stage_modules, stage_indices)]
    if layout.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn,
                                       scale_grads=True)
    cls = ScheduleGPipe if layout.pp_schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)


def _send(t: torch.Tensor, dst: int, group) -> None:
    code = _DTYPES.index(t.dtype)
    header = torch.tensor([code, t.dim(), *t.shape] + [0] * (6 - t.dim()), dtype=torch.int64,
                          device=t.device)
    dist.send(header, group_dst=dst, group=group)
    dist.send(t.contiguous(), group_dst=dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, group_src=src, group=group)
    code, ndim, *shape = header.tolist()
    out = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(out, group_src=src, group=group)
    return out


@torch.no_grad()
def forward_only(stage_modules: List[nn.Module], stage_indices: List[int], layout: Layout,
                 group, pp_rank: int, x: torch.Tensor, device: torch.device,
                 run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
    """Forward one micro-batch through every stage in order, sending activations over the pp
    group (evaluation needs no schedule); returns the last stage's output on its rank."""
    n_stages = layout.pp * layout.virtual_stages
    h: Optional[torch.Tensor] = None
    for s in range(n_stages):
        owner = s % layout.pp
        if owner != pp_rank:
            continue
        if s == 0:
            h = x
        elif h is None or (s - 1) % layout.pp != pp_rank:
            h = _recv((s - 1) % layout.pp, group, device)
        h = run(stage_modules[stage_indices.index(s)], h)
        if s < n_stages - 1 and (s + 1) % layout.pp != pp_rank:
            _send(h, (s + 1) % layout.pp, group)
    return h if (n_stages - 1) % layout.pp == pp_rank else None
