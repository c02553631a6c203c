"""A cluster as pools: nodes of one GPU type on one fabric, and the links between pools.

Mixed clusters (an H100 partition beside an A100 one, V100 nodes beside a T4 node) are what
small labs and academic Slurm sites run; the planner places pipeline stages' replicas on pools
(workbench.plan.pools.search), so all it needs per pool is the figures the cost model already
reads (a GpuSpec and its coefficients: a datasheet's, or the pool's own for a GPU no datasheet
matches) and, per pair of pools, what a transfer between them pays. A cluster without `pools`
is one pool made of its own fields, so every homogeneous plan is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config import ClusterConfig
from workbench.errors import ConfigError
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.hardware import GpuSpec, hardware_for, hardware_for_pool, match_gpu

# per-device figures a pool may give explicitly (0: the datasheet's, from its GPU name), and
# what each means: a GPU no datasheet matches is priced from these alone, so the ones REQUIRED
# must be given (peak_fp8_flops 0: no FP8; sm_count 0: GEMM tiles not modelled)
FIGURES: dict[str, str] = {
    "peak_bf16_flops": "its dense 16-bit tensor FLOP/s per device",
    "peak_fp32_flops": "its dense FP32 FLOP/s per device",
    "peak_fp8_flops": "its dense FP8 FLOP/s per device (0: none)",
    "hbm_bytes": "its memory per device in bytes",
    "hbm_bw_bytes_per_s": "its memory bandwidth in bytes/s",
    "intra_node_gbps": "GB/s one way per device inside a node (NVLink / PCIe)",
    "inter_node_gbps": "GB/s one way per device across nodes (its NIC share)",
    "sm_count": "its streaming multiprocessors (0: not modelled)",
}
REQUIRED = ("peak_bf16_flops", "peak_fp32_flops", "hbm_bytes", "hbm_bw_bytes_per_s",
            "intra_node_gbps", "inter_node_gbps")
# the placement text (workbench.plan.pools.placement) is written with these
NAME_CHARS = frozenset("+|:*, \t")


@dataclass(frozen=True)
class Pool:
    """Nodes of one GPU type: the spec the cost model evaluates them with, and how many."""

    name: str
    spec: GpuSpec
    nodes: int
    coeff: Coefficients

    @property
    def gpus(self) -> int:
        return self.nodes * self.spec.gpus_per_node


@dataclass(frozen=True)
class PoolLink:
    """What crossing from one pool to another costs one device: bytes/s one way, latency."""

    bytes_per_s: float
    latency_s: float


def _pool(cluster: Any, i: int, p: Any) -> Pool:
    where = f"cluster.pools[{i}]"
    given = {k: float(getattr(p, k, 0) or 0) for k in FIGURES}
    given = {k: (int(v) if k == "sm_count" else v) for k, v in given.items() if v > 0}
    try:
        match_gpu(str(p.gpu))
    except KeyError as e:  # a GPU no datasheet matches: priced from the pool's own figures
        if not given:  # no figure at all: a misspelt name more likely than a new GPU
            raise ConfigError(f"{where}.gpu", p.gpu, f"{e.args[0]}; or give its figures "
                              f"{', '.join(REQUIRED)} and gpus_per_node") from None
        for k in (*REQUIRED, "gpus_per_node"):
            if k not in given and not (k == "gpus_per_node" and int(p.gpus_per_node) > 0):
                what = FIGURES.get(k, "GPUs per node")
                raise ConfigError(f"{where}.{k}", getattr(p, k, 0),
                                  f"{what}: needed for gpu {p.gpu!r}, which no datasheet "
                                  f"matches ({e.args[0].split('; ')[-1]})") from None
    spec = hardware_for_pool(str(p.gpu), given, int(p.gpus_per_node))
    if int(p.nodes) < 1:
        raise ConfigError(f"{where}.nodes", p.nodes, "must be >= 1")
    if not str(p.name) or NAME_CHARS & set(str(p.name)):
        raise ConfigError(f"{where}.name", p.name, "a name without '+', '|', ':', '*', ',' or "
                                                   "spaces (placements are written with them)")
    co = coefficients(ClusterConfig(name=str(p.name), gpu=spec.name,
                                    coeff=dict(cluster.coeff or {}),
                                    peak_bf16_flops=spec.peak_bf16_flops,
                                    peak_fp8_flops=given.get("peak_fp8_flops", 0.0)))
    return Pool(str(p.name), spec, int(p.nodes), co)


def pools_of(cluster: Any) -> list[Pool]:
    """The cluster's pools in the order given; a cluster without `pools` is one pool of its
    own fields (ConfigError naming the key for a bad pool or link)."""
    pools_cfg = list(getattr(cluster, "pools", None) or [])
    if not pools_cfg:
        spec = hardware_for(cluster)
        return [Pool(str(cluster.name), spec, int(cluster.nodes), coefficients(cluster))]
    pools = [_pool(cluster, i, p) for i, p in enumerate(pools_cfg)]
    names = [p.name for p in pools]
    dup = next((n for n in names if names.count(n) > 1 or not n), None)
    if dup is not None:
        raise ConfigError("cluster.pools", names, f"pool names must be unique and non-empty "
                                                  f"({dup!r})")
    pool_links(cluster, pools)  # validated here, so a bad link fails before any search
    return pools


def pool_links(cluster: Any, pools: list[Pool]) -> dict[tuple[str, str], PoolLink]:
    """Every ordered pair of pools -> its PoolLink: the cluster's `links` entry, else the slower of
    the two pools' NICs (pools on one fabric) with the slower one's collective latency."""
    names = [p.name for p in pools]
    out: dict[tuple[str, str], PoolLink] = {}
    for a in pools:
        for b in pools:
            if a.name != b.name:
                lat = max(a.coeff.coll_latency_inter_s, b.coeff.coll_latency_inter_s)
                out[(a.name, b.name)] = PoolLink(
                    1e9 * min(a.spec.inter_node_gbps, b.spec.inter_node_gbps), lat)
    for i, ln in enumerate(list(getattr(cluster, "links", None) or [])):
        pair = [str(x) for x in ln.pools]
        if len(pair) != 2 or pair[0] == pair[1] or any(x not in names for x in pair):
            raise ConfigError(f"cluster.links[{i}].pools", pair,
                              f"must name two different pools of {', '.join(names)}")
        if not float(ln.gbps) > 0 or not float(ln.latency_s) >= 0:
            raise ConfigError(f"cluster.links[{i}]", f"gbps={ln.gbps} latency_s={ln.latency_s}",
                              "gbps must be > 0 and latency_s >= 0")
        link = PoolLink(1e9 * float(ln.gbps), float(ln.latency_s))
        out[(pair[0], pair[1])] = out[(pair[1], pair[0])] = link
    return out



def check_fp8(pools: list[Pool]) -> None:
    """FP8 linears need FP8 on every pool's GPU (ConfigError naming one without)."""
    none = [p for p in pools if not p.spec.peak_fp8_flops > 0]
    if none:
        raise ConfigError("--fp8", True, f"pools whose GPUs have FP8; pool {none[0].name} "
                                         f"({none[0].spec.name}) has none (its peak_fp8_flops "
                                         "is 0)")
