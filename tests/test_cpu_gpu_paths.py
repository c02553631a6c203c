"""The code paths a GPU run takes, run on the CPU so that the first GPU run does not find their
bugs: bf16 compute (autocast on one process and under DDP; FSDP2's MixedPrecisionPolicy on
gloo) and per-block torch.compile, each trained a few steps at world sizes 1 and 2 through the
real loop (the harness of test_parallel.py). bf16 keeps fp32 master parameters and tracks the
fp32 losses closely; compiled blocks give the eager losses."""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
from test_parallel import losses, make_case, max_rel_err, reference

from workbench.data.corpus import load as load_data
from workbench.testing.multirank import run_cases

SMALL = ["model.n_layers=2", "model.seq_len=64", "train.global_batch=4", "train.lr=3e-3"]


def _two_ranks(tmp_path, cases: Dict[str, List[str]]) -> Dict[str, Dict]:
    built = [make_case(name, 2, SMALL + ov, tmp_path) for name, ov in cases.items()]
    for case in built:
        case.ckpt_dir = ""  # loss cases need no checkpoints
    results = run_cases(2, built, load_data(built[0].cfg.data), str(tmp_path / "ranks"),
                        timeout_s=540)
    for case, result in zip(built, results):
        assert "error" not in result, (case.name, result.get("traceback"))
    return {c.name: r for c, r in zip(built, results)}


def _assert_trains(result: Dict) -> None:
    got = losses(result)
    assert all(math.isfinite(x) for x in got), got
    assert got[-1] < got[0], got
    assert math.isfinite(result["last"]["val_loss"])


def test_bf16_keeps_fp32_masters_and_tracks_fp32_at_world_1_and_2(tmp_path):
    ref = reference(tmp_path / "fp32", SMALL + ["train.dtype=fp32"])
    one = reference(tmp_path / "bf16", SMALL + ["train.dtype=bf16"])
    two = _two_ranks(tmp_path, {"ddp-bf16": ["layout=ddp", "train.dtype=bf16"],  # autocast
                                "fsdp-bf16": ["layout=fsdp", "train.dtype=bf16"]})  # MP policy
    for name, result in [("world1", one), *two.items()]:
        _assert_trains(result)
        assert result["param_dtypes"] == ["torch.float32"], name
        # bf16 matmuls round to 8 bits of mantissa: close to fp32, and not equal to it
        assert max_rel_err(losses(result), losses(ref)) < 1e-2, name
        assert losses(result) != losses(ref), name


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_losses_at_world_1_and_2(tmp_path):
    eager = reference(tmp_path / "eager", SMALL)
    one = reference(tmp_path / "compiled", SMALL + ["train.compile=true"])
    # the op recompute policy traced into the compiled block (its context_fn under compile)
    one_op = reference(tmp_path / "compiled-op", SMALL + ["train.compile=true",
                                                          "layout.recompute=selective_op"])
    two = _two_ranks(tmp_path, {"fsdp-compiled": ["layout=fsdp", "train.compile=true"]})
    for name, result in [("world1", one), ("world1-op", one_op), *two.items()]:
        _assert_trains(result)
        assert max_rel_err(losses(result), losses(eager)) < 1e-4, name
