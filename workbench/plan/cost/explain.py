"""`python -m workbench.plan ... --explain LAYOUT`: where one layout's memory and time go.

A planner that says "does not fit" or "fits" is only useful if a user can check why: this prints
the peak-memory itemization of the rank that peaks (weights, gradients, optimizer states,
activations, each buffer, fragmentation and fixed allowances) and the step-time terms, from the
same `evaluate` (workbench.plan.cost.estimate) the ranking uses, so the parts always add up to
what the ranking printed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.errors import ConfigError
from workbench.layout import Layout
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.columns import layout_columns
from workbench.plan.cost.communication import group_bw, nic_rails
from workbench.plan.cost.estimate import MEM_TERMS, TIME_TERMS, estimate_of_row, evaluate
from workbench.plan.cost.hardware import GIB, GpuSpec, hardware_for
from workbench.plan.cost.measured_terms import source, term_sources
from workbench.plan.cost.per_rank import per_rank
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stacks import software_for
from workbench.plan.search.rules import engine_only, validate_layout

# (label, key in evaluate's terms) in print order; the buffer and fixed lines are their parts.
MEMORY_LINES = (
    ("weights", "mem_params_bytes"), ("gradients", "mem_grads_bytes"),
    ("optimizer states", "mem_optimizer_bytes"), ("activations", "mem_activations_bytes"),
    ("buffers: logits + loss", "mem_buf_logits_bytes"),
    ("buffers: FSDP gathered weights/grads", "mem_buf_fsdp_bytes"),
    ("buffers: recomputed working layer", "mem_buf_recompute_layer_bytes"),
    ("buffers: pipeline send/recv", "mem_buf_p2p_bytes"),
    ("allocator fragmentation", "mem_fragmentation_bytes"),
)
FIXED_LABEL = "fixed (CUDA context, NCCL, cuBLAS)"
MEASURED_FIXED_LABEL = "fixed (measured: a process before any model)"


@dataclass(frozen=True)
class GroupPath:
    """The path one group's collectives take and the bandwidth the model gives it: `size` ranks
    `stride` apart, over `nodes` nodes, using `nics` NICs of each node (NCCL's rails: one ring
    per member on a node); nics 0 inside a node (NVLink)."""

    size: int
    stride: int
    nodes: int
    nics: int
    bytes_per_s: float


@dataclass(frozen=True)
class Explanation:
    """One layout's itemized peak memory (bytes, summing to peak_bytes) and step time (s)."""

    layout: Layout
    memory_bytes: dict[str, float]
    peak_bytes: float
    hbm_bytes: float
    margin_bytes: float
    peak_rank: int  # the pipeline rank that peaks: 0 first, 1 a middle one, 2 the last
    time_s: dict[str, float]
    step_time_s: float
    mfu: float
    paths: dict[str, GroupPath]
    sources: dict[str, str]  # time term -> where its durations come from
    source: str  # the cluster's figures: a profile (host, date) or the datasheet

    @property
    def fits(self) -> bool:
        return self.peak_bytes + self.margin_bytes <= self.hbm_bytes


def explain(model: ModelConfig, cluster: ClusterConfig, train: TrainConfig, key: str,
            lowrank: LowRankConfig | None = None, margin_gib: float = 0.0,
            world_size: int = 0, software: Software | None = None) -> Explanation:
    """Itemize the layout `key` (a Layout key as the ranking prints it) of `world_size` GPUs
    (0: the cluster's). A key of another world size or global batch is refused, not explained:
    its figures would answer a question the user did not ask (another cluster, another batch)."""
    try:
        layout = Layout.from_key(key)
    except (TypeError, ValueError) as e:
        raise ConfigError("--explain", key, f"a layout key as the ranking prints it ({e})"
                          ) from None
    world = world_size or cluster.nodes * cluster.gpus_per_node
    if layout.world_size != world:
        raise ConfigError("--explain", key,
                          f"a layout of the {world} GPUs planned (cluster.nodes x gpus_per_node, "
                          f"or --world-size); this one spans {layout.world_size}")
    if layout.global_batch != train.global_batch:
        raise ConfigError("--explain", key,
                          f"a layout of train.global_batch={train.global_batch}; this one's "
                          f"dp x mb x ga is {layout.global_batch}")
    try:
        validate_layout(layout, model, layout.world_size)
    except ConfigError as e:
        if not engine_only(e):  # a rule of the cost, not only of this repository's engine
            raise
    if margin_gib < 0:
        raise ConfigError("--margin-gib", margin_gib, "a non-negative number of GiB")
    shape, gpu = model_shape(model, lowrank), hardware_for(cluster)
    software, coeff = software or software_for(train, cluster), coefficients(cluster)
    cols = layout_columns([layout])
    t = evaluate(shape, gpu, coeff, software, cols)
    est = estimate_of_row(t, shape, gpu, software, cols, float(layout.global_batch),
                          layout.world_size, 0)
    rank = per_rank(shape, gpu, coeff, software, cols)
    shards, replicas = float(rank.shard_ranks[0]), float(rank.reduce_ranks[0])
    groups = {"tensor parallel": (layout.tp, 1), "context parallel": (layout.cp, layout.tp),
              "data parallel, sharded": (shards, layout.tp),
              "data parallel, replicated": (replicas, float(rank.reduce_stride[0])),
              "pipeline send": (2 if layout.pp > 1 else 1, layout.tp * replicas * shards)}
    mem = {label: float(t[k][0]) for label, k in MEMORY_LINES}
    fixed_label = MEASURED_FIXED_LABEL if gpu.measured else FIXED_LABEL
    mem[fixed_label] = float(t["mem_fixed_bytes"][0] - t["mem_fragmentation_bytes"][0])
    return Explanation(layout=layout, memory_bytes=mem,
                       peak_bytes=float(sum(t[k][0] for k in MEM_TERMS)),
                       hbm_bytes=gpu.hbm_bytes, margin_bytes=margin_gib * GIB,
                       peak_rank=int(t["mem_peak_rank"][0]),
                       time_s={k: float(t[k][0]) for k in TIME_TERMS},
                       step_time_s=est.step_time_s, mfu=est.mfu,
                       paths={name: _path_of(size, stride, gpu, coeff)
                              for name, (size, stride) in groups.items() if size > 1},
                       sources=term_sources(rank, shape, software.precision),
                       source=source(gpu.measured))


def _path_of(size: float, stride: float, gpu: GpuSpec, coeff: Coefficients) -> GroupPath:
    """The terms' own bandwidth for a group (communication.group_bw) and what it assumed: a
    user whose stack's collectives do not use a NIC per member (the README's hagemann2023
    notes) sees the assumption here and sets cluster.inter_node_gbps to match."""
    sizes, strides = np.array([float(size)]), np.array([float(stride)])
    inside = size * stride <= gpu.gpus_per_node
    return GroupPath(size=int(size), stride=int(stride),
                     nodes=1 if inside else int(-(-size * stride // gpu.gpus_per_node)),
                     nics=0 if inside else int(nic_rails(sizes, strides, gpu)[0]),
                     bytes_per_s=float(group_bw(sizes, strides, gpu, coeff)[0]))


def render(x: Explanation) -> list[str]:
    """The lines `--explain` prints."""
    where = ("first pipeline stage", "middle pipeline stage",
             "last pipeline stage (logits)")[x.peak_rank]
    out = [f"layout {x.layout.key()}  ({x.layout.world_size} GPUs)",
           f"peak memory per GPU, on the {where if x.layout.pp > 1 else 'one stage'}:"]
    for label, b in x.memory_bytes.items():
        out.append(f"  {label:<40}{b / GIB:>10.2f} GiB")
    verdict = "fits" if x.fits else "does NOT fit"
    out += [f"  {'total':<40}{x.peak_bytes / GIB:>10.2f} GiB",
            f"  {verdict} in {x.hbm_bytes / GIB:.1f} GiB with a {x.margin_bytes / GIB:.1f} GiB "
            f"margin (headroom {(x.hbm_bytes - x.peak_bytes) / GIB:.2f} GiB)",
            f"step time (figures: {x.source}):"]
    for k, s in x.time_s.items():
        where = f"   {x.sources[k]}" if k in x.sources else ""
        out.append(f"  {k.removeprefix('time_').removesuffix('_s'):<40}{s:>10.4f} s{where}")
    out.append(f"  {'total':<40}{x.step_time_s:>10.4f} s   (MFU {x.mfu:.1%})")
    if x.sources:  # a profiled cluster: the collectives' own curves, not these bandwidths
        return out
    out.append("links (GB/s the model gives each group; across nodes, a NIC per member on a node):")
    for name, path in x.paths.items():
        where = ("inside a node" if not path.nics else
                 f"over {path.nodes} nodes, {path.nics} NIC{'s' if path.nics > 1 else ''} per node")
        out.append(f"  {name:<27}{path.size:>5} ranks {where:<34}"
                   f"{path.bytes_per_s / 1e9:>8.1f} GB/s")
    return out
