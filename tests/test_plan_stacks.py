"""`python -m workbench.plan --stack NAME [--stack-fact KEY=VALUE] [--fp8]`: the planner prices
layouts with the same description of a stack the calibration scores that stack's published rows
with (one registry, workbench.plan.cost.stacks), and picks what its authors run."""

from __future__ import annotations

import csv

import pytest
from conftest import REPO

from workbench.cli import guarded
from workbench.compose import compose
from workbench.plan import __main__ as plan_main
from workbench.plan.accuracy.predict import predict_case, read_rows
from workbench.plan.accuracy.published import row_case, row_software
from workbench.plan.cost.coefficients import coefficients
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.hardware import GIB
from workbench.plan.cost.stack_facts import FACTS, plan_facts
from workbench.plan.cost.stacks import STACKS, describe, software_for, stack_software

FRONTIER = REPO / "benchmarks" / "calibration" / "frontier_layouts.csv"
NEMO_70B_64 = ["model=llama3_70b", "cluster=h100_8x_ib", "cluster.nodes=8",
               "train.global_batch=128"]


def _row(group: str, model: str, n_gpus: str) -> dict[str, str]:
    return next(r for r in read_rows(FRONTIER)[1]
                if (r["source_group"], r["model"], r["n_gpus"]) == (group, model, n_gpus))


def test_each_stack_is_the_software_its_published_rows_are_scored_with() -> None:
    """Megatron-Core: NeMo 24.07's rows (distributed optimizer, TP comm overlap, fp32
    gradients, TE FP8); torchtitan: a 1D FSDP2 row (eager in bf16, compiled under torchao FP8);
    every other stack: a row of that stack with no fact columns; this engine: its own
    software_for."""
    cfg = compose(NEMO_70B_64)
    train, cluster = cfg.train, cfg.cluster
    nemo = _row("nemo2407", "LLAMA2-70B", "64")
    assert stack_software("megatron", train, cluster, fp8=True) == row_case(nemo).software
    assert stack_software("megatron", train, cluster) == row_software(
        {**nemo, "precision": "BF16"})
    for name, spec in STACKS.items():
        if name == "workbench":
            continue
        for precision, fp8 in (("BF16", False), ("FP8", True))[:2 if spec.fp8_scaling else 1]:
            assert stack_software(name, train, cluster, fp8) == row_software(
                {"stack": name, "precision": precision}), (name, precision)
    assert stack_software("workbench", train, cluster) == software_for(train, cluster)
    assert {"workbench", "megatron", "megatron_2021", "deepspeed", "torchtitan",
            "meta_llama3", "aleph_alpha_scaling"} <= set(STACKS)


def test_every_calibration_row_is_its_stack_plus_its_fact_columns() -> None:
    """Every row of the project's calibration CSVs names a registered stack, and its Software is
    that stack's description with exactly the fact columns it sets: the planner's
    `--stack NAME --stack-fact ...` with the same facts prices it the same."""
    calibration = REPO / "benchmarks" / "calibration"
    n = 0
    for path in sorted(calibration.glob("*_layouts.csv")):
        for row in read_rows(path)[1]:
            assert row["stack"] in STACKS, (path.name, row["stack"])
            facts = {k: row[k] for k in FACTS if (row.get(k) or "").strip()
                     and not FACTS[k].layout}
            sw = row_software(row)
            plan = [f"{k}={v}" for k, v in facts.items()]
            assert sw == describe(row["stack"], sw.precision, plan_facts(plan))
            n += 1
    assert n >= 1000


def test_405b_memory_is_one_number_for_the_nemo_row_and_the_planner() -> None:
    """NeMo 24.09's 405B BF16 layout on 576 H100 (TP 8, PP 9, CP 2, VP 7): its row sets
    grad_buffer_bits=16 (an assumption: the layout only fits 80 GB with a 16-bit gradient
    buffer); `--stack megatron --stack-fact grad_buffer_bits=16` prices the same case to the
    same peak memory, and the stack's default fp32 buffer does not fit (docs/planner.md)."""
    row = next(r for r in read_rows(FRONTIER)[1] if (r["source_group"], r["n_gpus"],
                                                     r["precision"]) == ("dgxc_nemo2409", "576",
                                                                         "BF16"))
    assert row["stack"] == "megatron" and row["grad_buffer_bits"] == "16"
    case = row_case(row)

    def planned_gib(bits: int) -> float:
        sw = stack_software("megatron", case.train, case.cluster,
                            facts=plan_facts([f"grad_buffer_bits={bits}"]))
        return estimate(case.model, case.cluster, case.train, case.layout, software=sw,
                        coeff=coefficients(case.cluster)).peak_mem_bytes / GIB

    row_gib = predict_case(case).peak_mem_bytes / GIB
    assert planned_gib(16) == row_gib == pytest.approx(70.13, abs=0.01)
    assert planned_gib(32) == pytest.approx(81.12, abs=0.01) and planned_gib(32) > 80


def test_the_planner_cli_prices_the_405b_layout_as_its_row(capsys) -> None:
    """The documented command: the planner's --explain of that layout with the row's fact
    prints the row's 70.13 GiB; without it (fp32 buffer) 81.12 GiB, out of memory."""
    base = ["model=llama3_405b", "model.n_kv_heads=16", "cluster=h100_8x_ib",
            "cluster.nodes=72", "train.global_batch=252", "--stack", "megatron", "--explain",
            "dpr4_dps1_tp8_pp9_cp2_sp_mb1_ga63_rc-none_interleaved-1f1b-v7"]
    totals = {}
    for bits in (16, 32):
        assert plan_main.main(base + ["--stack-fact", f"grad_buffer_bits={bits}"]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"stack megatron+grad_buffer_bits={bits} (bf16)\n")
        total = next(ln for ln in text.splitlines() if ln.strip().startswith("total"))
        totals[bits] = float(total.split()[1])
    assert totals == {16: 70.13, 32: 81.12}


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
    (["--stack", "nosuch"], "--stack"),
    (["--fp8"], "--fp8"),  # this engine has no FP8 path
    (["--stack", "deepspeed", "--fp8"], "--fp8"),  # nor the 2021 DeepSpeed stack
    (["--stack", "megatron", "--stack-fact", "grad_buffer_bits=12"],
     "--stack-fact grad_buffer_bits"),
    (["--stack", "megatron", "--stack-fact", "nosuch=1"], "--stack-fact nosuch"),
    (["--stack", "megatron", "--stack-fact", "tp_overlap"], "--stack-fact"),
    (["--stack", "megatron", "--stack-fact", "local_batch=2"], "--stack-fact local_batch"),
    # a mixed cluster plans any stack, but FP8 only where every pool's GPU has it (A100: no)
    (["cluster=h100_a100_pools", "--stack", "megatron", "--fp8"], "--fp8"),
])
def test_an_unknown_stack_or_fp8_here_exits_2_with_one_line(bad, key, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        guarded(plan_main.main)(["model=llama3_8b", *bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {key}")
