"""The hybrid-parallel engine on 2 gloo ranks: every layout that divides a world of 2, with
recompute none, full, selective and selective_op, trains with per-step losses equal to the
single-process run (1e-5 relative); DDP's measured all-reduce bytes equal the gradient bytes,
FSDP's reduce-scatter bytes grad_accum times them;
distributed checkpoints resume bitwise in the same layout and load equal weights into another
layout; the op policy re-sends only what the cost model charges.

All cases run inside ONE spawned process group (workbench.testing.multirank): torchrun would pay
10-20 s per case. The 4-rank layouts are in test_parallel_4ranks.py (slow).
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from workbench import layout as layouts
from workbench.compose import compose
from workbench.config import RunConfig
from workbench.data.corpus import load as load_data
from workbench.plan.search.rules import validate_layout
from workbench.testing.multirank import Case, run_cases, run_single

REL_TOL = 1e-5
BASE = ["model=gpt_tiny", "train.steps=2", "train.global_batch=8", "train.micro_batch=2",
        "train.eval_batches=1", "train.eval_every=100", "train.ckpt_every=100",
        "train.warmup_steps=1", "tracking=none", "data.max_bytes=400000"]

# name -> overrides. The presets fill the whole world with one dimension, so these run at any
# world size that divides gpt_tiny (2 and 4).
SINGLE_DIMENSION: Dict[str, List[str]] = {
    "ddp": ["layout=ddp"],
    "fsdp": ["layout=fsdp"],
    "tp": ["layout=tp"],
    "tp_sp": ["layout=tp", "layout.sequence_parallel=true"],
    "pp_gpipe": ["layout=pp", "layout.pp_schedule=gpipe"],
    "pp_1f1b": ["layout=pp", "layout.pp_schedule=1f1b"],
}
# every one divides a world of 2 on gpt_tiny
LAYOUTS_2: Dict[str, List[str]] = {
    **SINGLE_DIMENSION,
    "pp_interleaved": ["layout=pp", "layout.pp_schedule=interleaved_1f1b",
                       "layout.virtual_stages=2"],
    "cp": ["layout.cp=2"],
}
AUTO_MB = ["train.micro_batch=0"]
RECOMPUTE = ["none", "full"]
RECOMPUTE_2 = RECOMPUTE + ["selective", "selective_op"]  # at 2 ranks only


def make_cfg(overrides: List[str]) -> RunConfig:
    return compose(BASE + overrides)


def make_case(name: str, world_size: int, overrides: List[str], ckpt_root,
              ckpt_name: str = "", **kw) -> Case:
    cfg = make_cfg(overrides)
    layout = layouts.resolve(cfg.layout, cfg.train, world_size)
    validate_layout(layout, cfg.model, world_size)
    return Case(name, cfg, layout, str(ckpt_root / (ckpt_name or name)), **kw)


def reference(tmp_root, overrides: List[str] = ()) -> Dict:
    """Single-process losses through the same loop (fresh checkpoint folder)."""
    cfg = make_cfg(list(overrides))
    layout = layouts.resolve(cfg.layout, cfg.train, 1)
    return run_single(cfg, layout, load_data(cfg.data), str(tmp_root / "single"))


def losses(result: Dict) -> List[float]:
    return [h["loss"] for h in result["history"]]


def grad_norms(result: Dict) -> List[float]:
    return [h["grad_norm"] for h in result["history"]]


def assert_matches_single_process(result: Dict, ref: Dict) -> None:
    """Per-step loss and grad norm, and the final val_loss, equal the one-process run's."""
    assert "error" not in result, result.get("traceback")
    assert max_rel_err(losses(result), losses(ref)) < REL_TOL
    assert max_rel_err(grad_norms(result), grad_norms(ref)) < REL_TOL
    # Evaluation sees the same sequences in every layout (eval_batches counts global batches).
    assert abs(result["last"]["val_loss"] - ref["last"]["val_loss"]) \
        < REL_TOL * ref["last"]["val_loss"]


def max_rel_err(got: List[float], want: List[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def run_matrix(world_size: int, layouts_by_name: Dict[str, List[str]], tmp_root,
               extra_cases: List[Case] = (), extra_overrides: List[str] = (),
               recompute: List[str] = RECOMPUTE) -> Dict[str, Dict]:
    cases = [make_case(f"{name}-rc_{rc}", world_size,
                       ov + [f"layout.recompute={rc}"] + list(extra_overrides),
                       tmp_root / "ckpt")
             for name, ov in layouts_by_name.items() for rc in recompute]
    for case in cases:
        case.ckpt_dir = ""  # loss cases need no checkpoints
    cases += list(extra_cases)
    data = load_data(cases[0].cfg.data)
    results = run_cases(world_size, cases, data, str(tmp_root / "ranks"), timeout_s=420)
    return {c.name: r for c, r in zip(cases, results)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel2")
    ckpt = root / "ckpt"
    ckpt_over = ["train.steps=4", "train.ckpt_every=2"]
    extra = [
        # Saved by FSDP at steps 2 and 4; then the step-4 checkpoint is dropped (a kill) and a
        # fresh FSDP engine resumes from step 2: steps 2-3 must repeat bitwise.
        make_case("dcp-fsdp", 2, ["layout=fsdp"] + ckpt_over, ckpt, fingerprint=True),
        make_case("dcp-fsdp-resumed", 2, ["layout=fsdp"] + ckpt_over, ckpt, "dcp-fsdp",
                  fingerprint=True, keep_up_to_step=2),
        # Other layouts load the same folder: tensor- and pipeline-parallel shards.
        make_case("dcp-into-tp", 2, ["layout=tp"] + ckpt_over, ckpt, "dcp-fsdp",
                  fingerprint=True, train=False),
        make_case("dcp-into-pp", 2, ["layout=pp"] + ckpt_over, ckpt, "dcp-fsdp",
                  fingerprint=True, train=False),
        make_case("dcp-into-cp", 2, ["layout.cp=2"] + ckpt_over, ckpt, "dcp-fsdp",
                  fingerprint=True, train=False),
        # The micro-batch left to the layout (train.micro_batch=0): 4 under DDP, 4 under a
        # 2-stage pipeline, 8 in one process.
        *[make_case(f"auto_mb-{name}", 2, [f"layout={name}", *AUTO_MB], ckpt) for name in
          ("ddp", "pp")],
    ]
    for case in extra[-2:]:
        case.ckpt_dir = ""
    results = run_matrix(2, LAYOUTS_2, root, extra, recompute=RECOMPUTE_2)
    return {"results": results, "ref": reference(root), "root": root,
            "ref_auto_mb": reference(root / "auto_mb", AUTO_MB)}


@pytest.mark.parametrize("recompute", RECOMPUTE_2)
@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_losses_match_single_process(two_ranks, name, recompute):
    assert_matches_single_process(two_ranks["results"][f"{name}-rc_{recompute}"],
                                  two_ranks["ref"])


@pytest.mark.parametrize("name", ["ddp", "pp"])
def test_val_loss_compares_across_layouts_that_pick_their_own_micro_batch(two_ranks, name):
    """With train.micro_batch left to the layout, DDP and a pipeline run micro-batches of 4
    where one process runs 8; validation counts global batches, so all three evaluate the
    same sequences and log the same val_loss (it counted micro-batches: 4 sequences vs 8)."""
    result, ref = two_ranks["results"][f"auto_mb-{name}"], two_ranks["ref_auto_mb"]
    assert "error" not in result, result.get("traceback")
    cfg, one = make_cfg([f"layout={name}", *AUTO_MB]), make_cfg(AUTO_MB)
    assert layouts.resolve(cfg.layout, cfg.train, 2).micro_batch == 4
    assert layouts.resolve(one.layout, one.train, 1).micro_batch == 8
    assert_matches_single_process(result, ref)


def test_metrics_are_measured_per_step(two_ranks):
    for name, result in two_ranks["results"].items():
        if "error" in result or not result["history"]:
            continue
        step = result["history"][-1]
        for key in ("tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes",
                    "comm/allreduce_bytes", "comm/reduce_scatter_bytes",
                    "comm/allgather_bytes", "comm/p2p_bytes", "comm/bytes_per_step"):
            assert key in step, (name, key)
        parts = sum(step[f"comm/{k}_bytes"] for k in ("allreduce", "reduce_scatter",
                                                      "allgather", "p2p"))
        assert step["comm/bytes_per_step"] >= parts > 0, name
    pp = two_ranks["results"]["pp_1f1b-rc_none"]["history"][-1]
    assert pp["comm/p2p_bytes"] > 0
    fsdp = two_ranks["results"]["fsdp-rc_none"]["history"][-1]
    assert fsdp["comm/reduce_scatter_bytes"] > 0 and fsdp["comm/allgather_bytes"] > 0


def test_ddp_allreduce_bytes_equal_gradient_bytes(two_ranks):
    """So that low-rank savings measured later can be trusted: what DDP all-reduces in a step
    is the fp32 gradient of every parameter (plus the 4-byte loss)."""
    from workbench.train.model import n_params

    cfg = make_cfg(LAYOUTS_2["ddp"])
    grad_bytes = 4 * n_params(cfg.model)
    for rc in RECOMPUTE:
        step = two_ranks["results"][f"ddp-rc_{rc}"]["history"][-1]
        assert abs(step["comm/allreduce_bytes"] - grad_bytes) <= 0.05 * grad_bytes, \
            (step["comm/allreduce_bytes"], grad_bytes)


def test_tp_without_sp_all_reduces_each_projections_input_gradient(two_ranks):
    """Tensor parallel without SP: per layer and micro-batch, 2 all-reduces forward (attention
    and MLP outputs) and one backward per column-parallel projection (q, k, v, and the SwiGLU
    gate and up: 5), each micro_batch x seq_len x hidden x 4 bytes; plus the embedding's output
    and the head's input gradient once each, and the 4-byte loss. The cost model's stack for
    this engine charges the same 2 + 5 a layer (`Software.separate_qkv`, `separate_gate_up`)."""
    cfg = make_cfg(LAYOUTS_2["tp"])
    m, t = cfg.model, cfg.train
    unit = t.micro_batch * m.seq_len * m.hidden * 4
    micro_batches = t.global_batch // t.micro_batch  # dp = 1 under tp 2
    for rc in ("none", "selective_op"):  # the op policy re-sends no reduction
        step = two_ranks["results"][f"tp-rc_{rc}"]["history"][-1]
        assert step["comm/allreduce_bytes"] == micro_batches * unit * (m.n_layers * (2 + 5) + 2) + 4


def test_fsdp_reduce_scatters_every_micro_batch(two_ranks):
    """Without a pipeline, FSDP reduce-scatters each micro-batch's fp32 gradients (counted as
    the unreduced input: every parameter, 4 bytes) rather than keeping unsharded gradients
    until the last one: grad_accum x the gradient bytes a step, what the cost model charges
    (workbench.plan.cost.data_parallel) and what its memory itemization assumes."""
    from workbench.train.model import n_params

    cfg = make_cfg(LAYOUTS_2["fsdp"])
    ga = cfg.train.global_batch // (2 * cfg.train.micro_batch)
    assert ga > 1
    for rc in RECOMPUTE:
        step = two_ranks["results"][f"fsdp-rc_{rc}"]["history"][-1]
        assert step["comm/reduce_scatter_bytes"] == pytest.approx(
            ga * 4 * n_params(cfg.model), rel=0.01)


def test_context_parallel_gathers_exactly_the_keys_and_values(two_ranks):
    """Full recomputation repeats each attention's forward, so it adds one K/V all-gather per
    layer and micro-batch: 2 (K and V) x micro_batch x seq_len x kv width x 4 bytes, gathered
    over the whole sequence. FSDP's own gathers are the same with and without recompute."""
    from workbench.train.model import head_dim

    cfg = make_cfg(LAYOUTS_2["cp"])
    m, t = cfg.model, cfg.train
    per_gather = 2 * t.micro_batch * m.seq_len * m.n_kv_heads * head_dim(m) * 4
    micro_batches = t.global_batch // t.micro_batch  # dp = 1: every micro-batch on each rank
    res = two_ranks["results"]
    extra = res["cp-rc_full"]["history"][-1]["comm/allgather_bytes"] \
        - res["cp-rc_none"]["history"][-1]["comm/allgather_bytes"]
    assert extra == m.n_layers * micro_batches * per_gather


def test_dcp_resume_same_layout_is_bitwise(two_ranks):
    res = two_ranks["results"]
    first, again = res["dcp-fsdp"], res["dcp-fsdp-resumed"]
    assert "error" not in first and "error" not in again, (first.get("traceback"),
                                                             again.get("traceback"))
    by_step = {h["step"]: h["loss"] for h in first["history"]}
    resumed = {h["step"]: h["loss"] for h in again["history"]}
    assert sorted(resumed) == [2, 3]  # it resumed from the step-2 checkpoint
    assert all(resumed[s] == by_step[s] for s in resumed)  # bitwise
    assert again["weights"] == first["weights"]


@pytest.mark.parametrize("target", ["tp", "pp", "cp"])
def test_dcp_loads_into_another_layout_with_equal_weights(two_ranks, target):
    res = two_ranks["results"]
    loaded, saved = res[f"dcp-into-{target}"], res["dcp-fsdp-resumed"]
    assert "error" not in loaded, loaded.get("traceback")
    assert loaded["resumed_at"] == 4
    assert loaded["weights"] == saved["weights"]
    assert len(loaded["weights"]) == len(saved["weights"]) > 0


def test_op_policy_sends_again_only_what_the_cost_model_charges(two_ranks):
    """`selective_op` keeps every reduction's output (all-reduce; reduce-scatter under SP), so
    it re-sends none of them; under SP it redoes the two all-gathers a layer (the cost model:
    half a pass's TP traffic), micro_batch x seq_len x hidden x 4 bytes each; under CP it
    redoes the K/V gathers as full recompute does (the cost model: one more forward ring)."""
    res = two_ranks["results"]

    def comm(name: str, rc: str, kind: str) -> float:
        return res[f"{name}-rc_{rc}"]["history"][-1][f"comm/{kind}_bytes"]

    cfg = make_cfg(LAYOUTS_2["tp_sp"])
    m, t = cfg.model, cfg.train
    gathers = 2 * m.n_layers * (t.global_batch // t.micro_batch)  # dp = 1 under tp 2
    for kind in ("allreduce", "reduce_scatter", "allgather"):
        assert comm("tp", "selective_op", kind) == comm("tp", "none", kind), kind
    assert comm("tp_sp", "selective_op", "reduce_scatter") == comm("tp_sp", "none",
                                                                    "reduce_scatter")
    assert comm("tp_sp", "selective_op", "allgather") - comm("tp_sp", "none", "allgather") \
        == gathers * t.micro_batch * m.seq_len * m.hidden * 4
    assert comm("cp", "selective_op", "allgather") == comm("cp", "full", "allgather")
