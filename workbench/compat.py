"""Every private PyTorch API the workbench relies on, in one place.

Each is a name with a leading underscore that a PyTorch release may rename or drop without
notice; when one does, this module is the one file to mend. Only `torch` is imported at module
level, and only where a function runs, so importing this module costs nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Sequence

import torch


# --- c10d backends and process groups ---
def backend_registered(name: str) -> bool:
    """Whether c10d already knows a backend of this name (registration is process-wide and
    cannot be repeated)."""
    import torch.distributed as dist

    return name.upper() in dist.Backend._plugins


def nccl_options(timeout: timedelta) -> Any:
    """ProcessGroupNCCL options carrying the collective timeout (only settable privately)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def allgather_base(group: Any, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
    """A backend's flat all-gather into one tensor (what all_gather_into_tensor ends in)."""
    return group._allgather_base(output, input, opts)


def reduce_scatter_base(group: Any, output: torch.Tensor, input: torch.Tensor,
                        opts: Any) -> Any:
    """A backend's flat reduce-scatter of one tensor (what reduce_scatter_tensor ends in)."""
    return group._reduce_scatter_base(output, input, opts)


# --- DeviceMesh ---
def flatten_mesh(mesh: Any, name: str) -> Any:
    """Several dimensions of a DeviceMesh as one named dimension (FSDP over dp_shard x cp)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: Sequence[Any]) -> Any:
    """One DeviceMesh whose dimensions are those of `meshes`, in order (HSDP over a flattened
    shard dimension)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(list(meshes))


# --- tensors ---
def foreach_mul_(tensors: List[torch.Tensor], scalar: torch.Tensor) -> None:
    """Multiply every tensor in place by one scalar tensor, in one fused call."""
    torch._foreach_mul_(tensors, scalar)


# --- PowerSGD ---
def powersgd_should_compress() -> Callable[..., Any]:
    """PyTorch's rule for which gradients PowerSGD compresses (n, m, rank, min rate) ->
    (compress?, uncompressed size, compressed size)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    return psgd._should_compress
