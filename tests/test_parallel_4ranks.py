"""Every layout on 4 gloo ranks (ddp, fsdp, tp, tp+sp, pp gpipe/1f1b, interleaved, dp x tp, pp x
tp, fsdp x tp, and context parallel with fsdp, ddp, tp+sp and pp), recompute none, and full
where dimensions combine: per-step losses and gradient norms equal the single-process run within
1e-5 relative; FSDP in a pipeline and TP x PP send the bytes the cost model counts. One spawned
process group runs them all; slow (a few minutes on 2 cores) but part of CI."""

from __future__ import annotations

from typing import Dict, List

import pytest
from test_parallel import (
    RECOMPUTE,
    SINGLE_DIMENSION,
    assert_matches_single_process,
    make_case,
    make_cfg,
    reference,
    run_matrix,
)

# Every layout of the issue at world 4 (interleaved needs pp*v | 4 layers: pp=2, v=2, dp=2).
LAYOUTS_4: Dict[str, List[str]] = {
    **SINGLE_DIMENSION,
    "pp_interleaved_dp": ["layout.dp_shard=2", "layout.pp=2",
                          "layout.pp_schedule=interleaved_1f1b", "layout.virtual_stages=2"],
    "dp_tp": ["layout.dp_replicate=2", "layout.tp=2"],
    "pp_tp": ["layout=tp_pp"],
    "fsdp_tp": ["layout=fsdp_tp"],
    # context parallel next to each other dimension (FSDP shards over dp_shard x cp)
    "fsdp_cp": ["layout.dp_shard=2", "layout.cp=2"],
    "ddp_cp": ["layout.dp_replicate=2", "layout.cp=2"],
    "tp_sp_cp": ["layout.tp=2", "layout.sequence_parallel=true", "layout.cp=2"],
    "pp_cp": ["layout.pp=2", "layout.pp_schedule=1f1b", "layout.cp=2"],
}
# Two steps: the gradient norm is compared too, so a wrong gradient scale shows at step 0.
STEPS = ["train.steps=2"]


# Recompute on one dimension alone is checked at world 2 (test_parallel.py, every mode); here it
# runs where dimensions combine.
CASES_4 = [(name, rc) for name in LAYOUTS_4 for rc in RECOMPUTE
           if rc == "none" or name not in SINGLE_DIMENSION]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel4")
    combined = {n: ov for n, ov in LAYOUTS_4.items() if n not in SINGLE_DIMENSION}
    single = [make_case(f"{n}-rc_none", 4, ov + ["layout.recompute=none", *STEPS], root / "ckpt")
              for n, ov in SINGLE_DIMENSION.items()]
    for case in single:
        case.ckpt_dir = ""  # loss cases need no checkpoints
    results = run_matrix(4, combined, root, extra_cases=single, extra_overrides=STEPS)
    return {"results": results, "ref": reference(root, STEPS)}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "recompute"), CASES_4)
def test_four_rank_losses_match_single_process(four_ranks, name, recompute):
    assert_matches_single_process(four_ranks["results"][f"{name}-rc_{recompute}"],
                                  four_ranks["ref"])


@pytest.mark.slow
def test_fsdp_in_a_pipeline_gathers_and_reduces_once_a_step(four_ranks):
    """Inside the pipeline schedule FSDP keeps a stage's weights gathered from its first
    forward and reduce-scatters its accumulated gradients once, after its last backward
    (torch.distributed.pipelining): every parameter gathered and reduced once a step whatever
    the micro-batch count, as the cost model charges (workbench.plan.cost.data_parallel
    .fsdp_once). Counted per rank and averaged over the 4 ranks, two of which hold each stage:
    half the model's fp32 bytes for each kind."""
    from workbench.train.model import n_params

    cfg = make_cfg(LAYOUTS_4["pp_interleaved_dp"] + STEPS)
    assert cfg.train.global_batch // (2 * cfg.train.micro_batch) > 1  # several micro-batches
    res = four_ranks["results"]["pp_interleaved_dp-rc_none"]
    assert "error" not in res, res.get("traceback")
    step = res["history"][-1]
    half_model = 4 * n_params(cfg.model) / 2
    assert step["comm/allgather_bytes"] == pytest.approx(half_model, rel=0.01)
    assert step["comm/reduce_scatter_bytes"] == pytest.approx(half_model, rel=0.01)


@pytest.mark.slow
def test_pipeline_sends_the_whole_activation_from_each_tp_rank_without_sp(four_ranks):
    """tp 2 x pp 2 without sequence parallelism: the stage output is replicated over the TP
    ranks and each sends all of it (torch.distributed.pipelining sends what the TP plan
    leaves), one activation forward or one gradient backward a micro-batch on every rank:
    micro_batch x seq_len x hidden x 4 bytes, grad_accum times a step. The cost model's
    stack for this engine says the same (`p2p_tp_split` False; Megatron sends 1/tp)."""
    cfg = make_cfg(LAYOUTS_4["pp_tp"] + STEPS)
    assert cfg.layout.tp == 2 and not cfg.layout.sequence_parallel
    m, t = cfg.model, cfg.train
    res = four_ranks["results"]["pp_tp-rc_none"]
    assert "error" not in res, res.get("traceback")
    ga = t.global_batch // t.micro_batch  # dp 1
    assert res["history"][-1]["comm/p2p_bytes"] == ga * t.micro_batch * m.seq_len * m.hidden * 4
