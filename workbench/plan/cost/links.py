"""Bandwidth and latency of a group of ranks as the cost model sees the cluster: NVLink inside a
node, the members' NICs across nodes (one ring per rail, as NCCL runs them). workbench.plan.terms
prices every collective and pipeline transfer with these; plan --explain prints them."""

from __future__ import annotations

import numpy as np

from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.hardware import GpuSpec


def nic_rails(size: np.ndarray, stride: np.ndarray, hw: GpuSpec) -> np.ndarray:
    """Members of a group that share a node: a group spanning nodes runs one ring per member
    (rail), each over its own NIC, so cross-node bandwidth adds up across them (NCCL)."""
    return np.clip(hw.gpus_per_node / np.maximum(stride, 1), 1, np.maximum(size, 1))


def group_bw(size: np.ndarray, stride: np.ndarray, hw: GpuSpec, co: Coefficients) -> np.ndarray:
    """Bytes/s of a group of `size` ranks `stride` apart: NVLink when it fits in one node, else
    the NICs of the members on one node together, never more than NVLink."""
    intra_bw = hw.intra_node_gbps * co.link_eff_intra
    inter_bw = np.minimum(hw.inter_node_gbps * co.link_eff_inter * nic_rails(size, stride, hw),
                          intra_bw)
    return np.where(size * stride <= hw.gpus_per_node, intra_bw, inter_bw) * 1e9


def collective_link(size: np.ndarray, stride: np.ndarray, hw: GpuSpec, co: Coefficients
          ) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/s, latency s) of one collective over `size` ranks `stride` apart; the latency
    takes one hop per doubling of the group (tree / ring steps)."""
    per = np.where(size * stride <= hw.gpus_per_node, co.coll_latency_intra_s,
                   co.coll_latency_inter_s)
    hops = np.where(size > 1, per * (1.0 + np.log2(np.maximum(size, 1))), 0.0)
    return group_bw(size, stride, hw, co), hops
