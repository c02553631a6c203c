"""A calibration row's stated inter-node fabric sets the per-GPU NIC share the cost model uses;
a text that does not fix it leaves the datasheet node (one NIC per GPU)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from workbench.plan.accuracy.fabric import inter_node_gbps_per_gpu
from workbench.plan.accuracy.predict import default_csv, predict_case
from workbench.plan.accuracy.published import row_case
from workbench.plan.cost.hardware import cluster_for

PROJECT = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration"


@pytest.mark.parametrize("text, gpus_per_node, gbps", [
    ("NVLink/NVSwitch intra; 8x200Gb/s HDR IB per node", 8, 25.0),
    ("NVLink intra; 8x400Gb/s NDR IB per node", 8, 50.0),
    ("NVLink intra; RDMA 400Gb/s (CX-7) per GPU", 8, 50.0),
    ("NVLink intra; RoCE 400Gb/s per GPU", 8, 50.0),
    ("NVLink intra; 1x200Gb/s HDR IB per node", 8, 25.0 / 8),
    ("200 Gb/s HDR per node", 4, 25.0 / 4),
])
def test_stated_fabrics_give_the_per_gpu_share(text: str, gpus_per_node: int,
                                               gbps: float) -> None:
    assert inter_node_gbps_per_gpu(text, gpus_per_node) == pytest.approx(gbps)


@pytest.mark.parametrize("text", ["", "not stated", "200Gb/s HDR InfiniBand",
                                  "NVLink intra; 200Gb/s HDR IB"])
def test_a_rate_without_per_node_or_per_gpu_is_not_guessed(text: str) -> None:
    assert inter_node_gbps_per_gpu(text, 8) is None


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_every_published_fabric_matches_its_datasheet_node() -> None:
    """The sources that state their fabric run one NIC per GPU (DGX, Grand Teton): reading the
    column must not move any of their predictions."""
    paths = [p for p in (default_csv(), PROJECT / "frontier_layouts.csv") if p.is_file()]
    stated = 0
    for row in (r for p in paths for r in _rows(p)):
        nic = inter_node_gbps_per_gpu(row.get("interconnect") or "", 8)
        if nic is None:
            continue
        stated += 1
        default = cluster_for(row["gpu_type"], int(row["n_gpus"])).inter_node_gbps
        assert nic == pytest.approx(default), row["interconnect"]
    assert stated >= 30


def test_one_nic_per_node_slows_the_data_parallel_sync() -> None:
    """A hagemann2023 row with the fabric written in: one 200 Gb/s link per node is 1/8 of the
    DGX default, and the in-step fp32 all-reduce + gather cross nodes 8x slower."""
    row = next(r for r in _rows(PROJECT / "hagemann2023_layouts.csv")
               if r.get("value") and r["tp"] == "1" and r["pp"] == "1")
    assert not row["interconnect"]  # the paper's count is not read from a primary source
    base = predict_case(row_case(row))
    one = row_case({**row, "interconnect": "1x200Gb/s HDR IB per node"})
    assert one.cluster.inter_node_gbps == pytest.approx(25.0 / 8)
    slow = predict_case(one)
    dp = "time_dp_comm_exposed_s"
    assert slow.time_s[dp] == pytest.approx(8 * base.time_s[dp], rel=0.05)
    assert slow.time_s["time_fwd_s"] == base.time_s["time_fwd_s"]
