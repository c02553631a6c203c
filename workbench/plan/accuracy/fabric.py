"""A published run's inter-node fabric, read from the words its source uses.

The cost model's inter-node bandwidth is per GPU (its share of the node's NICs,
ClusterConfig.inter_node_gbps). Datasheet nodes (DGX A100/H100, Grand Teton) have one NIC per
GPU, and cluster_for assumes that. A source that states its fabric says it one of three ways:
NICs x rate per node ("8x200Gb/s HDR IB per node"), a rate per GPU ("RDMA 400Gb/s per GPU"),
or a bare rate ("200Gb/s HDR InfiniBand"). The first two fix the per-GPU share; the third does
not (one such link per node, or one per GPU, differ 8x on an 8-GPU node), so it is left to the
datasheet default rather than guessed.
"""

from __future__ import annotations

import re

_RATE = r"(\d+(?:\.\d+)?)\s*gb/?s"  # a link rate in Gb/s, as papers write it
_PER_NODE = re.compile(r"(\d+)\s*x\s*" + _RATE + r"[^;]*?per\s+node")
_ONE_PER_NODE = re.compile(_RATE + r"[^;]*?per\s+node")
_PER_GPU = re.compile(_RATE + r"[^;]*?per\s+gpu")


def inter_node_gbps_per_gpu(text: str, gpus_per_node: int) -> float | None:
    """GB/s one way per GPU that the stated fabric gives, or None when the text does not fix
    it (empty, "not stated", or a rate without saying per node or per GPU)."""
    t = (text or "").lower()
    if m := _PER_NODE.search(t):
        return int(m.group(1)) * float(m.group(2)) / 8.0 / max(gpus_per_node, 1)
    if m := _ONE_PER_NODE.search(t):
        return float(m.group(1)) / 8.0 / max(gpus_per_node, 1)
    if m := _PER_GPU.search(t):
        return float(m.group(1)) / 8.0
    return None
