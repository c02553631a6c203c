"""A row's training stack is typed: a `stack` column and fact columns, one table of them
(docs/planner.md "Stack facts"); `notes` is text for people, read by nobody; a wrong stack or
fact value stops `validate` with one line and exit 2."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from workbench.errors import ConfigError
from workbench.plan.accuracy.predict import read_rows
from workbench.plan.accuracy.published import row_case, row_software
from workbench.plan.cost.stack_facts import FACTS
from workbench.plan.cost.stacks import STACKS, describe

CALIBRATION = REPO / "benchmarks" / "calibration"
# the 405B BF16 row of NeMo 24.09 on 576 H100 (stack megatron, grad_buffer_bits 16)
NEMO_405B = next(r for r in read_rows(CALIBRATION / "frontier_layouts.csv")[1]
                 if (r["source_group"], r["n_gpus"], r["precision"])
                 == ("dgxc_nemo2409", "576", "BF16"))
OLD_KEYWORDS = ("tp-comm-overlap; overlap-param-gather; grad-buffer-bf16; dp-sync-in-step; "
                "separate-gate-up; gathered-logits; kernel torch; softmax-fp32; noflash; "
                "eager-elementwise; compile; asynctp; float8 all-gather; cp by all-gather; "
                "no load balancing; flash_attention v1; fused-rmsnorm; overlap-grad-reduce; "
                "sequence-parallel; pp-group=4; local batch 32; interleaved")


def _bare(row: dict[str, str]) -> dict[str, str]:
    """The row without any fact column set."""
    return {k: ("" if k in FACTS else v) for k, v in row.items()}


@pytest.mark.parametrize("stack", ["megatron", "aleph_alpha_scaling", "torchtitan"])
def test_notes_keywords_are_read_by_nobody(stack: str) -> None:
    """The old keywords in notes, and no fact columns: the row gets its stack's defaults."""
    row = {**_bare(NEMO_405B), "stack": stack}
    case = row_case({**row, "notes": OLD_KEYWORDS})
    assert case == row_case({**row, "notes": ""})
    assert case.software == describe(stack, "bf16")


def test_fact_columns_override_the_stack_defaults_and_unknown_columns_are_ignored() -> None:
    row = NEMO_405B
    sw = row_case(row).software
    assert sw.grad_buffer_bytes == 2.0 and sw == describe("megatron", "bf16",
                                                          {"grad_buffer_bits": "16"})
    assert row_case({**row, "grad_buffer_bits": ""}).software.grad_buffer_bytes == 4.0
    assert row_case({**row, "whatever_else": "x"}) == row_case(row)
    off = row_case({**row, "tp_overlap": "0", "sequence_parallel": "false"})
    assert not off.software.overlap_tp and not off.layout.sequence_parallel
    assert row_case({**row, "tp_overlap": "0"}).layout.sequence_parallel is False
    kernel = row_software({"stack": "aleph_alpha_scaling", "attention_kernel": "flash1",
                           "pp_group": "4", "cp_algorithm": "allgather",
                           "cp_load_balance": "FALSE"})
    assert kernel.flash_v1 and kernel.pp_group == 4 and kernel.cp_allgather
    assert not kernel.cp_load_balance


@pytest.mark.parametrize("column,value,valid", [
    ("stack", "megatron-core", "one of workbench, megatron"),
    ("stack", "", "one of workbench"),
    ("grad_buffer_bits", "8", "one of 16, 32"),
    ("tp_overlap", "yes", "true or false"),
    ("attention_kernel", "flash3", "one of flash2, flash1"),
    ("pp_group", "-1", "an integer >= 0"),
])
def test_a_wrong_stack_or_fact_value_is_an_error_naming_the_column(column, value,
                                                                   valid) -> None:
    with pytest.raises(ConfigError, match=re.escape(column)) as e:
        row_case({**NEMO_405B, column: value})
    assert valid in str(e.value)


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list({k: 0 for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.mark.parametrize("column,value", [("stack", "nemo"), ("grad_buffer_bits", "24"),
                                          ("compiled", "maybe")])
def test_validate_refuses_a_wrong_stack_or_fact_with_one_line_and_exit_2(tmp_path, column,
                                                                         value) -> None:
    rows = [NEMO_405B, {**NEMO_405B, column: value}]
    src, out = _write(tmp_path / "rows.csv", rows), tmp_path / "pred.csv"
    p = subprocess.run([sys.executable, "-m", "workbench.plan.validate", "--csv", str(src),
                        "--out", str(out)], capture_output=True, text=True, check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].startswith(f"error: {column} (line 3 of rows.csv)={value!r}")
    assert not out.exists()


def test_validate_reads_the_typed_columns(tmp_path) -> None:
    """The same row with and without its 16-bit buffer fact: 70.13 / 81.12 GiB."""
    src = _write(tmp_path / "rows.csv", [NEMO_405B, {**NEMO_405B, "grad_buffer_bits": ""}])
    out = tmp_path / "pred.csv"
    p = subprocess.run([sys.executable, "-m", "workbench.plan.validate", "--csv", str(src),
                        "--out", str(out)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    got = [r["pred_peak_mem_gib"] for r in csv.DictReader(out.open())]
    assert got == ["70.13", "81.12"]


def test_the_docs_table_documents_every_fact_and_stack_once() -> None:
    """docs/planner.md's "Stack facts" table has one row per fact column, and names every
    stack of the registry."""
    text = (REPO / "docs" / "planner.md").read_text()
    section = text.split("### Stack facts", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert sorted(documented) == sorted(FACTS) and len(documented) == len(set(documented))
    for name in STACKS:
        assert f"`{name}`" in section, name
