"""The engine: the `Engine` protocol over a model laid out on this rank's mesh, for every world
size (one rank is a mesh of size 1: parallelize then has nothing to split or reduce).

The loop is the same for every layout; here live the differences: micro-batches run through a
pipeline schedule or one module with gradient sync on the last micro-batch only; the reported
loss is the global-batch mean on every rank; the gradient norm is summed over shards and stages.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import get_total_norm

from workbench import compat
from workbench.config import RunConfig, compute_dtype
from workbench.layout import Layout
from workbench.train.engine import Batch
from workbench.train.engine.bookkeeping import Bookkeeping
from workbench.train.model import cross_entropy
from workbench.train.parallel import comm
from workbench.train.parallel.context import cp_positions
from workbench.train.parallel.mesh import Mesh, build_mesh, uses_fsdp
from workbench.train.parallel.parallelize import data_parallel, parallelize
from workbench.train.parallel.pipeline import forward_only, make_schedule, stage_ids


def autocast(device: torch.device, dtype: str) -> AbstractContextManager:
    """bf16 autocast when the run computes in bf16 (and parameters stay fp32 masters)."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


_PARTS = ("tok_embeddings", "pos_embeddings", "norm", "output")


def checkpoint_view(stages: List[nn.Module]) -> nn.Module:
    """One module over this rank's stages whose parameter names are the global ones
    (`layers.5...`), so a checkpoint written in one layout loads into another."""
    if len(stages) == 1:
        return stages[0]
    view = nn.Module()
    layers = nn.ModuleDict()
    for stage in stages:
        for name in _PARTS:
            if getattr(stage, name, None) is not None:
                setattr(view, name, getattr(stage, name))
        for key, block in stage.layers.items():
            layers[key] = block
    view.layers = layers
    return view


class MeshEngine:
    """DDP-style replication / FSDP2 / TP(+SP) / CP / PP on one named mesh, or none of them.
    `counter` is the ByteCounter the process group was created with (comm.process_group)."""

    def __init__(self, model: nn.Module, mesh: Mesh, layout: Layout, cfg: RunConfig,
                 device: torch.device, counter: comm.ByteCounter):
        self.mesh, self.layout, self.cfg, self.device = mesh, layout, cfg, device
        self.counter = counter
        self.bookkeeping = Bookkeeping(counter, device, mesh.rank, dist.get_world_size())
        self.dp_rank, self.dp_size, self.is_main = mesh.dp_rank, mesh.dp_size, mesh.is_main
        # FSDP's mixed-precision policy casts parameters itself; otherwise autocast does.
        self.dtype = "fp32" if uses_fsdp(layout) else compute_dtype(cfg.train, cfg.cluster)
        # The sequence positions this rank holds under context parallelism (None: all).
        self.seq_index = cp_positions(cfg.model.seq_len, layout.cp, mesh.coord("cp")).to(device) \
            if layout.cp > 1 else None
        self.dp = data_parallel(layout, mesh, cfg, device)
        self.rebuild(model)

    def rebuild(self, model: nn.Module) -> None:
        """Parallelize a full model over the same mesh, and run it from now on (FSDP2 and
        replication cannot change the parameters under them, so a new model is laid out anew)."""
        layout = self.layout
        with self.bookkeeping.uncounted():
            self.parts = parallelize(model, self.mesh, layout, self.cfg, self.device, self.dp)
        self.view = checkpoint_view(self.parts)
        self.schedule = None
        if layout.pp > 1:
            self.stage_indices = stage_ids(layout, self.mesh.pp_rank)
            n_stages = layout.pp * layout.virtual_stages
            self.has_first = 0 in self.stage_indices
            self.has_last = n_stages - 1 in self.stage_indices
            self.schedule = make_schedule(self.parts, self.stage_indices, layout, self.device,
                                          self.mesh.group("pp"), layout.grad_accum,
                                          cross_entropy)

    def _params(self) -> List[nn.Parameter]:
        return [p for s in self.parts for p in s.parameters()]

    def register_comm_hook(self, make_state: Callable[[nn.Module, Any], Any],
                           hook: Callable) -> List[Any]:
        states = [self.dp.register_comm_hook(p, make_state, hook) for p in self.parts]
        return [s for s in states if s is not None]

    # --- steps ---
    def train_step(self, micro_batches: List[Batch]) -> float:
        self.counter.reset()
        for p in self.parts:
            p.train()
        micro_batches = [self._local(mb) for mb in micro_batches]
        if self.schedule is not None:
            local = self._pipeline_step(micro_batches)
        else:
            local = self._accumulate(micro_batches)
        return self._global_mean(local)

    def _local(self, batch: Batch) -> Batch:
        """This rank's part of a batch: its two sequence chunks under context parallelism."""
        if self.seq_index is None:
            return batch
        return batch[0].index_select(1, self.seq_index), batch[1].index_select(1, self.seq_index)

    def _accumulate(self, micro_batches: List[Batch]) -> torch.Tensor:
        """Gradient accumulation: gradients meet the other data-parallel ranks' on the last
        micro-batch (FSDP reduce-scatters on every one, and all-reduces over dp_replicate on
        the last), as the cost model charges (workbench.plan.cost.data_parallel)."""
        model, n = self.parts[0], len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            self.dp.set_sync(model, i == n - 1)
            with autocast(self.device, self.dtype):
                loss = cross_entropy(model(x), y) / n
            loss.backward()
            total += loss.detach()
        return total

    def _pipeline_step(self, micro_batches: List[Batch]) -> torch.Tensor:
        x = torch.cat([mb[0] for mb in micro_batches])
        y = torch.cat([mb[1] for mb in micro_batches])
        losses: List[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs: Dict[str, Any] = {"target": y, "losses": losses} if self.has_last else {}
        with autocast(self.device, self.dtype):
            self.schedule.step(*args, **kwargs)
        return self._from_last_stage(torch.stack(losses).mean() if losses else None)

    def _from_last_stage(self, value: Optional[torch.Tensor]) -> torch.Tensor:
        """The last stage's scalar on every stage (a sum over the pp group, zeros elsewhere)."""
        dtype = torch.float32 if value is None else value.dtype
        out = torch.zeros((), device=self.device, dtype=dtype)
        if value is not None:
            out += value.detach()
        group = self.mesh.group("pp")
        if group is not None:
            dist.all_reduce(out, group=group)
        return out

    def _global_mean(self, local: torch.Tensor) -> float:
        """Mean over data- and context-parallel ranks of each rank's mean: the global-batch
        mean, since every such rank holds an equal share of the tokens."""
        local = local.detach().to(torch.promote_types(local.dtype, torch.float32)).clone()
        for name in ("dp_replicate", "dp_shard", "cp"):
            group = self.mesh.group(name)
            if group is not None:
                dist.all_reduce(local, group=group)
        return float(local) / (self.dp_size * self.mesh.size("cp"))

    @torch.no_grad()
    def eval_loss(self, batches: List[Batch]) -> float:
        for p in self.parts:
            p.eval()
        # summed in float64: a mean over many batches keeps the digits its batches have
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for x, y in map(self._local, batches):
            with autocast(self.device, self.dtype):
                if self.schedule is None:
                    total += cross_entropy(self.parts[0](x), y)
                    continue
                out = forward_only(self.parts, self.stage_indices, self.layout,
                                   self.mesh.group("pp"), self.mesh.pp_rank, x, self.device,
                                   lambda m, h: m(h))
                if out is not None:
                    total += cross_entropy(out, y)
        if self.schedule is not None:
            total = self._from_last_stage(total)
        return self._global_mean(total / len(batches))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of all gradients, then scale them to at most `max_norm`. Gradients
        sharded alike (the same mesh dimensions) take their local norm together, squared and
        summed over those dimensions, then over pipeline stages; with nothing to reduce (one
        process, or replication) this is torch.nn.utils.clip_grad_norm_'s arithmetic."""
        by_key: Dict[tuple, List[torch.Tensor]] = {}
        groups: Dict[tuple, list] = {}
        for p in self._params():
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                # Sequence-parallel norm gains get partial sums per sequence shard: reduce them
                # now (the optimizer would, later) so the norm sees the true gradient.
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl
                                                   for pl in g.placements])
                p.grad = g
            key: tuple = ()
            if isinstance(g, DTensor):
                # Any shard-like placement (FSDP's _StridedShard over TP included) splits the
                # tensor across that mesh dimension; replicated dimensions count once.
                dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
                key = (id(g.device_mesh), dims)
                groups[key] = [g.device_mesh.get_group(i) for i in dims]
                g = g.to_local()
            groups.setdefault(key, [])
            by_key.setdefault(key, []).append(g)
        norms = {key: get_total_norm(grads) for key, grads in by_key.items()}
        pp = self.mesh.group("pp")
        if len(norms) == 1 and not groups[next(iter(norms))] and pp is None:
            norm = next(iter(norms.values())).float()
        else:
            total = torch.zeros((), device=self.device, dtype=torch.float32)
            for key, n in norms.items():
                sq = n.float().pow(2)
                for group in groups[key]:
                    dist.all_reduce(sq, group=group)
                total += sq
            if pp is not None:
                dist.all_reduce(total, group=pp)
            norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [g for gs in by_key.values() for g in gs]
        if grads:
            compat.foreach_mul_(grads, coef.to(grads[0].dtype))
        return float(norm)

    # --- checkpoints: keyed by parameter name (DTensor shards) for torch.distributed.checkpoint
    def state_dict(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        state = {"model": get_model_state_dict(self.view)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.view, optimizer)
        return state

    def load_state_dict(self, state: Dict[str, Any],
                        optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        set_model_state_dict(self.view, state["model"])
        if optimizer is None:
            return
        # DCP saves non-tensor values (a group's betas, eps, weight decay) from the coordinator
        # rank only, so a pipeline rank whose parameters rank 0 does not hold gets its groups
        # back without them: keep this optimizer's own (they come from the config).
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        set_optimizer_state_dict(self.view, optimizer, state["optimizer"])
        for group, own in zip(optimizer.param_groups, hyper):
            for key, value in own.items():
                group.setdefault(key, value)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        with self.bookkeeping.uncounted():
            full = get_model_state_dict(self.view,
                                        options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().to("cpu") for k, v in full.items()}


def make_engine(model: nn.Module, cfg: RunConfig, layout: Layout, rank: int,
                device: torch.device, counter: comm.ByteCounter) -> MeshEngine:
    """Build the mesh once for this rank, and the engine around the full seeded model; the
    process group exists already (comm.process_group), one rank included."""
    return MeshEngine(model, build_mesh(layout, device, rank), layout, cfg, device, counter)
