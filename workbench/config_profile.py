"""The schema of a profiled cluster's measurements (`cluster.profile`, written by
`python -m workbench.profile`): curves and tables, each a set of equal-length columns, so that a
cluster file stays readable and the cost model reads them as arrays (workbench.plan.cost.measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class Curve:
    """Seconds of one operation at each payload size (bytes ascending)."""

    bytes: List[float] = field(default_factory=list)
    s: List[float] = field(default_factory=list)


@dataclass
class GemmTable:
    """Forward and backward (dX and dW) seconds of (tokens, k) @ (k, n), one row per shape."""

    dtype: str = "fp32"
    k: List[int] = field(default_factory=list)
    n: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    fwd_s: List[float] = field(default_factory=list)
    bwd_s: List[float] = field(default_factory=list)


@dataclass
class BlockTable:
    """One transformer block and the loss as a rank of degree tp holds them, per token count."""

    model: str = ""
    shape: str = ""  # workbench.profile.rank.block_key: what the block's time depends on
    dtype: str = "fp32"
    tp: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    fwd_s: List[float] = field(default_factory=list)
    bwd_s: List[float] = field(default_factory=list)
    loss_fwd_s: List[float] = field(default_factory=list)
    loss_bwd_s: List[float] = field(default_factory=list)


@dataclass
class OptimizerPoint:
    model: str = ""
    params: float = 0.0
    tensors: float = 0.0
    step_s: float = 0.0  # AdamW step with clipping, the whole model on one rank


@dataclass
class ComputeLevel:
    """What one rank computes while `ranks` ranks of its host compute at once."""

    ranks: int = 1
    threads: int = 0  # intra-op threads per rank (0: a GPU)
    elementwise: Curve = field(default_factory=Curve)
    gemm: List[GemmTable] = field(default_factory=list)
    blocks: List[BlockTable] = field(default_factory=list)
    optimizer: List[OptimizerPoint] = field(default_factory=list)


@dataclass
class CommCurve:
    """A collective over disjoint groups of `group` ranks, all busy at once."""

    kind: str = "all_reduce"  # all_reduce | all_gather | reduce_scatter | p2p
    group: int = 2
    span: str = "intra"  # intra: every group inside a node; inter: across nodes
    ranks: int = 0  # ranks busy with it at once (the groups timed together); 0: all of them
    bytes: List[float] = field(default_factory=list)
    s: List[float] = field(default_factory=list)
    measure_s: float = 0.0


@dataclass
class MemoryCheck:
    model: str = ""
    micro_batch: int = 1
    baseline_bytes: float = 0.0  # held before any model: the memory model's fixed allowance
    step_peak_bytes: float = 0.0  # peak over one training step of `model`


@dataclass
class ProfileMeta:
    """Where and when a profile was measured: what it is valid for."""

    when: str = ""
    host: str = ""
    torch: str = ""
    device_type: str = "cpu"
    device_name: str = ""
    world: int = 1
    nodes: int = 1
    hosts: int = 1
    cores_per_host: int = 0
    ranks_per_host: int = 1
    command: str = ""


@dataclass
class ProbeTable:
    """One micro-batch of the real engine per kind of parallelism, degree, layer count and
    micro-batch (workbench/profile/probes.py)."""

    model: str = ""
    shape: str = ""  # workbench.plan.cost.shapes.block_key of the model probed
    kind: List[str] = field(default_factory=list)
    degree: List[int] = field(default_factory=list)
    # ranks of the job running probes at once (world/degree groups); empty: the degree alone
    busy: List[int] = field(default_factory=list)
    layers: List[int] = field(default_factory=list)
    micro_batch: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)  # per rank
    step_s: List[float] = field(default_factory=list)
    # the rank's block at the row's tokens, forward and backward without the engine, timed
    # beside the probe's steps (its speed at that moment); empty in profiles before it
    ref_s: List[float] = field(default_factory=list)
    # the engine's optimizer step after the probe's step (its gradient clipping, AdamW over its
    # parameters, zeroing: as the loop runs it); empty in profiles before it
    opt_s: List[float] = field(default_factory=list)
    dtype: str = ""  # what the probes computed in (the reference's block table)


@dataclass
class ClusterProfile:
    """Measured by `python -m workbench.profile` on the cluster itself (workbench/profile/)."""

    measured: ProfileMeta = field(default_factory=ProfileMeta)
    compute: List[ComputeLevel] = field(default_factory=list)
    comms: List[CommCurve] = field(default_factory=list)
    memory: MemoryCheck = field(default_factory=MemoryCheck)
    probes: List[ProbeTable] = field(default_factory=list)
