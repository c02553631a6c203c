"""`python -m workbench.plan --stack megatron|torchtitan [--fp8]`: the planner prices layouts as
the calibration scored that stack's published rows, and picks what its authors run."""

from __future__ import annotations

import csv

import pytest
from conftest import REPO

from workbench.cli import guarded
from workbench.compose import compose
from workbench.plan import __main__ as plan_main
from workbench.plan.accuracy.predict import read_rows
from workbench.plan.accuracy.published import _software, row_case
from workbench.plan.cost.stacks import STACKS, software_for, stack_software

FRONTIER = REPO / "benchmarks" / "calibration" / "frontier_layouts.csv"
NEMO_70B_64 = ["model=llama3_70b", "cluster=h100_8x_ib", "cluster.nodes=8",
               "train.global_batch=128"]


def _row(group: str, model: str, n_gpus: str) -> dict[str, str]:
    return next(r for r in read_rows(FRONTIER)[1]
                if (r["source_group"], r["model"], r["n_gpus"]) == (group, model, n_gpus))


def test_each_stack_is_the_software_its_published_rows_are_scored_with() -> None:
    """Megatron-Core: NeMo 24.07's rows (distributed optimizer, TP comm overlap, fp32
    gradients, TE FP8); torchtitan: a 1D FSDP2 row as validate reads it (eager in bf16,
    compiled under torchao FP8); this engine: its own software_for."""
    cfg = compose(NEMO_70B_64)
    train, cluster = cfg.train, cfg.cluster
    nemo = _row("nemo2407", "LLAMA2-70B", "64")
    assert stack_software("megatron", train, cluster, fp8=True) == row_case(nemo).software
    assert stack_software("megatron", train, cluster) == _software(
        "BF16", nemo["notes"], nemo["zero_or_fsdp"])
    for precision, fp8 in (("BF16", False), ("FP8", True)):
        assert stack_software("torchtitan", train, cluster, fp8) == _software(precision, "",
                                                                              "FSDP2")
    assert stack_software("workbench", train, cluster) == software_for(train, cluster)
    assert set(STACKS) == {"workbench", "megatron", "torchtitan"}


def test_megatron_fp8_plan_picks_nemos_published_layout_for_70b_on_64_gpus(tmp_path,
                                                                            capsys) -> None:
    """NVIDIA tuned Llama 3 70B FP8 on 64 H100 to TP 4, PP 4, CP 2 (NeMo 24.07's table, and
    dgxc-benchmarking's 24.09 recipe); planning for that stack ranks those degrees first, and
    prices them within 10% of the table's 746 model TFLOP/s per GPU."""
    out = tmp_path / "rank.csv"
    assert plan_main.main(NEMO_70B_64 + ["--stack", "megatron", "--fp8", "--top", "3",
                                         "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stack megatron (fp8, MFU of the BF16 peak)" in text
    best = next(csv.DictReader(out.open()))
    assert "_tp4_pp4_cp2_" in best["layout"] and best["layout"].startswith("dpr2_dps1_")
    assert float(best["mfu"]) * 989 == pytest.approx(746, rel=0.10)  # vs the BF16 dense peak
    # the same command for this engine's stack prices the stack, not only the precision
    bf16 = tmp_path / "bf16.csv"
    assert plan_main.main(NEMO_70B_64 + ["--stack", "megatron", "--top", "0",
                                         "--out", str(bf16)]) == 0
    capsys.readouterr()
    assert float(next(csv.DictReader(bf16.open()))["mfu"]) < float(best["mfu"])
    # --explain itemizes it under the same stack: the parts the ranking used
    assert plan_main.main(NEMO_70B_64 + ["--stack", "megatron", "--fp8", "--explain",
                                         best["layout"]]) == 0
    text = capsys.readouterr().out
    assert text.startswith("stack megatron (fp8)\n")
    total = next(ln for ln in text.splitlines() if ln.strip().startswith("total"))
    assert float(total.split()[1]) == pytest.approx(float(best["peak_mem_gib"]), abs=0.01)


@pytest.mark.parametrize("bad,key", [
    (["--stack", "deepspeed"], "--stack"),
    (["--fp8"], "--fp8"),  # this engine has no FP8 path
    # a mixed cluster plans any stack, but FP8 only where every pool's GPU has it (A100: no)
    (["cluster=h100_a100_pools", "--stack", "megatron", "--fp8"], "--fp8"),
])
def test_an_unknown_stack_or_fp8_here_exits_2_with_one_line(bad, key, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        guarded(plan_main.main)(["model=llama3_8b", *bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {key}")
