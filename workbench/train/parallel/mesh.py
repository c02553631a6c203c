"""The named DeviceMesh of a layout, built once per rank and passed down (no global groups).

Dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost, so that on GPUs
its heavy traffic stays on the fastest links). Only dimensions of degree > 1 are created, except
that dp_shard is kept at degree 1 when dp_replicate must be expressed through FSDP2's HSDP form
(replication next to DTensor parameters, where DDP cannot go). With context parallelism,
dp_shard and cp are also flattened into "dp_shard_cp": cp ranks hold the same parameters and
their gradients are averaged with the data-parallel ones, so FSDP2 shards over both (as
torchtitan does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench import compat
from workbench.layout import Layout

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def uses_ddp(layout: Layout) -> bool:
    """Plain DDP: replication is the only parallelism. Next to DTensor parameters (tp) DDP
    cannot reduce, and inside a pipeline schedule its reducer (armed at forward time) deadlocks
    with several micro-batches in flight; both use FSDP2 in its replicate (HSDP) form."""
    return layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.tp == 1 \
        and layout.pp == 1 and layout.cp == 1


def uses_fsdp(layout: Layout) -> bool:
    """FSDP2 shards (dp_shard > 1, or over the cp ranks), or replicates as HSDP next to tensor
    or pipeline parallelism."""
    return layout.dp_shard > 1 or layout.cp > 1 or (layout.dp > 1 and not uses_ddp(layout))


def mesh_shape(layout: Layout) -> List[Tuple[str, int]]:
    keep_shard = uses_fsdp(layout)
    dims = []
    for name in ORDER:
        degree = getattr(layout, name)
        if degree > 1 or (name == "dp_shard" and keep_shard):
            dims.append((name, degree))
    return dims


@dataclass
class Mesh:
    """The rank's mesh and its coordinates; `dims` maps a name to its degree (absent = 1)."""

    mesh: Optional[DeviceMesh]
    dims: Dict[str, int]
    rank: int
    fsdp: Optional[DeviceMesh] = None  # what FSDP2 shards over (see build_mesh)

    def size(self, name: str) -> int:
        return self.dims.get(name, 1)

    def coord(self, name: str) -> int:
        if self.mesh is None or name not in self.dims:
            return 0
        return self.mesh.get_local_rank(name)

    def group(self, name: str) -> Optional[Any]:
        """The process group of one dimension, or None when the degree is 1."""
        if self.mesh is None or self.size(name) == 1:
            return None
        return self.mesh.get_group(name)

    def sub(self, *names: str) -> DeviceMesh:
        assert self.mesh is not None
        present = tuple(n for n in names if n in self.dims)
        return self.mesh[present if len(present) > 1 else present[0]]

    @property
    def dp_size(self) -> int:
        return self.size("dp_replicate") * self.size("dp_shard")

    @property
    def dp_rank(self) -> int:
        """Position among data-parallel replicas: ranks that differ only in tp/pp/cp share it,
        and therefore read the same slice of the global batch."""
        return self.coord("dp_replicate") * self.size("dp_shard") + self.coord("dp_shard")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def is_main(self) -> bool:
        """The rank that holds the loss (last pipeline stage) at data/tensor/context rank 0."""
        return (self.pp_rank == self.size("pp") - 1 and self.dp_rank == 0
                and self.coord("tp") == 0 and self.coord("cp") == 0)


def build_mesh(layout: Layout, device: torch.device, rank: int) -> Mesh:
    """One init_device_mesh call per rank; needs the default process group (main.py, or the
    multi-rank harness)."""
    dims = mesh_shape(layout)
    if not dims:
        return Mesh(None, {}, rank)
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device.type, tuple(d for _, d in dims), mesh_dim_names=names)
    out = Mesh(mesh, dict(dims), rank)
    if uses_fsdp(layout):
        out.fsdp = _fsdp_mesh(out)
    return out


def _fsdp_mesh(m: Mesh) -> DeviceMesh:
    """(dp_replicate,) dp_shard; with context parallelism dp_shard x cp flattened into one
    "dp_shard_cp" dimension (2-D with dp_replicate: HSDP)."""
    if m.size("cp") == 1:
        return m.sub("dp_replicate", "dp_shard")
    assert m.mesh is not None
    flat = compat.flatten_mesh(m.mesh["dp_shard", "cp"], "dp_shard_cp")
    if "dp_replicate" not in m.dims:
        return flat
    return compat.concatenate_meshes([m.mesh["dp_replicate"], flat])
