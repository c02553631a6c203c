"""Property tests of the cost model: physics that must hold whatever the coefficients."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.estimate import MEM_TERMS, TIME_TERMS, estimate
from workbench.plan.cost.hardware import cluster_for, match_gpu
from workbench.plan.cost.shapes import lowrank_flops_ratio, model_shape
from workbench.plan.cost.software import Software

MODEL = ModelConfig(name="m", family="llama", n_layers=16, hidden=2048, n_heads=16,
                    n_kv_heads=8, ffn_hidden=5632, vocab=32000, seq_len=2048)
TRAIN = TrainConfig(global_batch=64, micro_batch=1, dtype="bf16")


def cluster(n: int = 64) -> ClusterConfig:
    return cluster_for("H100-SXM-80GB", n)


layouts = st.builds(
    lambda tp, pp, cp, dps, mb, rc, sp: Layout(
        dp_replicate=64 // (tp * pp * cp * dps), dp_shard=dps, tp=tp, pp=pp, cp=cp,
        sequence_parallel=sp and tp > 1, micro_batch=mb,
        grad_accum=max(1, 64 // (64 // (tp * pp * cp) * mb)), recompute=rc),
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
    st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from(["none", "selective",
                                                                         "full"]),
    st.booleans())


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_estimates_finite_positive_and_breakdown_sums(lay: Layout) -> None:
    e = estimate(MODEL, cluster(lay.world_size), TRAIN, lay)
    for v in (e.step_time_s, e.peak_mem_bytes, e.tokens_per_s, e.mfu, e.hfu):
        assert math.isfinite(v) and v > 0
    assert e.hfu >= e.mfu
    assert math.isclose(sum(e.time_s.values()), e.step_time_s, rel_tol=1e-9)
    assert math.isclose(sum(e.mem_bytes.values()), e.peak_mem_bytes, rel_tol=1e-9)
    assert set(e.time_s) == set(TIME_TERMS) and set(e.mem_bytes) == set(MEM_TERMS)
    m = e.as_metrics()
    assert {"step_time_s", "peak_mem_bytes", "tokens_per_s", "mfu", "hfu"} <= set(m)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.booleans())
def test_raising_tp_never_raises_param_memory(tp: int, dps: int, sp: bool) -> None:
    def params(t: int) -> float:
        lay = Layout(dp_replicate=64 // (t * dps), dp_shard=dps, tp=t, sequence_parallel=sp and
                     t > 1, grad_accum=1)
        return estimate(MODEL, cluster(), TRAIN, lay).mem_bytes["mem_params_bytes"]

    assert params(tp * 2) <= params(tp)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 8]), st.sampled_from([1, 2]), st.booleans(), st.booleans())
def test_recompute_lowers_activations_and_raises_compute(tp: int, mb: int, sp: bool,
                                                         flash: bool) -> None:
    from workbench.plan.cost.software import Software

    sw = Software(flash_attention=flash, dropout=not flash)
    est = {rc: estimate(MODEL, cluster(), TRAIN, Layout(dp_replicate=64 // tp, tp=tp,
                                                        sequence_parallel=sp and tp > 1,
                                                        micro_batch=mb, recompute=rc),
                        software=sw) for rc in ("none", "selective", "full", "selective_op")}
    act = {k: e.mem_bytes["mem_activations_bytes"] for k, e in est.items()}
    comp = {k: e.time_s["time_recompute_s"] + e.time_s["time_fwd_s"] + e.time_s["time_bwd_s"]
            for k, e in est.items()}
    assert act["full"] < act["selective"] < act["none"]
    assert comp["none"] < comp["selective"] < comp["full"]
    # The op policy keeps some outputs of every block and redoes its cheap ops. Without SP it
    # keeps less than no recompute by (kv + 2 ffn) / tp a token; with SP the saved output of the
    # last row-parallel matmul (the whole hidden width, before its reduce-scatter) can outweigh
    # what SP shards, as at tp 8.
    assert act["full"] < act["selective_op"]
    assert act["selective_op"] < act["none"] or (sp and tp > 1)
    assert comp["none"] < comp["selective_op"] < comp["full"]


def test_lowrank_flops_ratio() -> None:
    assert math.isclose(lowrank_flops_ratio(4096, 1024, 256), 256 * (4096 + 1024) / (4096 * 1024))
    lr = LowRankConfig(mode="fixed", rank_ratio=0.25, keep_first_blocks=0, keep_last_blocks=0)
    dense, low = model_shape(MODEL), model_shape(MODEL, lr)
    for (m, n, _), (a, r, _), (r2, b, _) in zip(dense.dense, low.lowrank[::2], low.lowrank[1::2]):
        assert (a, b) == (m, n) and r == r2
        assert math.isclose((a * r + r * b) / (m * n), lowrank_flops_ratio(m, n, r))
    assert low.model_flops_per_token() < dense.model_flops_per_token()
    lay = Layout(dp_replicate=64)
    assert estimate(MODEL, cluster(), TRAIN, lay, lr).step_time_s < \
        estimate(MODEL, cluster(), TRAIN, lay).step_time_s


def test_tp_across_nodes_is_slower() -> None:
    lay = Layout(dp_replicate=4, tp=16, sequence_parallel=True)
    big = ModelConfig(**{**MODEL.__dict__, "n_heads": 32, "n_kv_heads": 16})
    c8, c16 = cluster_for("H100-SXM-80GB", 64, 8), cluster_for("H100-SXM-80GB", 64, 16)
    t8 = estimate(big, c8, TRAIN, lay).time_s["time_tp_comm_s"]
    t16 = estimate(big, c16, TRAIN, lay).time_s["time_tp_comm_s"]
    assert t8 > t16 > 0


def test_counts_match_train_model() -> None:
    from workbench.train.model import flops_per_token, matmul_params

    for m in (MODEL, ModelConfig(name="g", family="gpt2", n_layers=4, hidden=256, n_heads=4,
                                 n_kv_heads=4, ffn_hidden=1024, vocab=1000, seq_len=128,
                                 bias=True, tie_embeddings=True)):
        ms = model_shape(m)
        assert ms.n_layers * ms.layer_matmul_params() + m.vocab * m.hidden == matmul_params(m)
        assert math.isclose(ms.model_flops_per_token(), flops_per_token(m))


def test_korthikanti_activation_memory() -> None:
    """Korthikanti et al. eq. 2: sbh(10 + 24/t + 5as/(ht)) bytes per layer, no SP/recompute."""
    from workbench.plan.cost.software import Software

    gpt = ModelConfig(name="22b", family="gpt2", n_layers=48, hidden=6144, n_heads=64,
                      n_kv_heads=64, ffn_hidden=24576, vocab=51200, seq_len=2048,
                      tie_embeddings=True)
    sw = Software(precision="fp16", flash_attention=False, dropout=True)
    e = estimate(gpt, cluster_for("A100 80GB", 8), TRAIN, Layout(tp=8, micro_batch=4),
                 software=sw)
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    want = 48 * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert math.isclose(e.mem_bytes["mem_activations_bytes"], want, rel_tol=1e-9)


def test_gpu_names_match_loosely() -> None:
    assert match_gpu("A100-SXM-80GB (Selene DGX A100)").name == "A100-SXM-80GB"
    assert match_gpu("A100 40GB").name == "A100-SXM-40GB"
    assert match_gpu("H100 (80GB)").name == "H100-SXM-80GB"
    assert match_gpu("H100 PCIe").name == "H100-PCIe-80GB"
    assert match_gpu("H100 96GB HBM2e (500W, Grand Teton)").power_capped
    assert match_gpu("H200 141GB").name == "H200-SXM-141GB"


def _big(seq: int = 8192) -> ModelConfig:
    return ModelConfig(name="b", family="llama", n_layers=8, hidden=4096, n_heads=32,
                       n_kv_heads=8, ffn_hidden=14336, vocab=32000, seq_len=seq)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([2, 4, 8]))
def test_ring_attention_costs_imbalance_and_short_chunks(cp: int) -> None:
    from workbench.plan.cost.software import Software

    lay = Layout(dp_shard=8 // cp, cp=cp, micro_batch=1, grad_accum=1)
    c = cluster_for("H100-SXM-80GB", 8)
    bal = estimate(_big(), c, TRAIN, lay, software=Software(cp_load_balance=True))
    naive = estimate(_big(), c, TRAIN, lay, software=Software(cp_load_balance=False))
    assert naive.step_time_s > bal.step_time_s  # causal imbalance without load balancing
    # same tokens per rank, sequence cp times longer: attention per rank grows by more than
    # cp (shorter ring chunks run below the one-kernel efficiency, partial outputs are merged)
    one = estimate(_big(8192 // cp), c, TRAIN, Layout(dp_shard=8, micro_batch=1, grad_accum=1))
    fwd = {k: e.time_s["time_fwd_s"] for k, e in (("one", one), ("cp", bal))}
    assert fwd["cp"] > fwd["one"]


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([2, 4, 8]))
def test_allgather_context_parallel_as_this_engine_runs_it(cp: int) -> None:
    """The engine's cp (train/parallel/context.py): one attention kernel, an exposed K/V all-gather
    and reduce-scatter, and the other ranks' K/V stored per layer; the ring hides its
    exchange behind attention but pays per-chunk kernels."""
    from workbench.plan.cost.software import Software

    lay = Layout(dp_shard=8 // cp, cp=cp, micro_batch=1, grad_accum=1)
    c = cluster_for("H100-SXM-80GB", 8)
    ring = estimate(_big(), c, TRAIN, lay, software=Software(cp_load_balance=True))
    gather = estimate(_big(), c, TRAIN, lay, software=Software(cp_allgather=True))
    assert estimate(_big(), c, TRAIN, lay).as_metrics() == gather.as_metrics()  # engine default
    assert gather.time_s["time_cp_comm_s"] > ring.time_s["time_cp_comm_s"]
    assert gather.time_s["time_fwd_s"] < ring.time_s["time_fwd_s"]
    m = _big()
    kv_bytes = m.n_layers * (m.seq_len // cp) * (cp - 1) * 2 * m.n_kv_heads * 128 * 2
    extra = gather.mem_bytes["mem_activations_bytes"] - ring.mem_bytes["mem_activations_bytes"]
    assert math.isclose(extra, kv_bytes, rel_tol=1e-9)


def test_deepspeed_zero3_gathers_are_slower_and_bound_by_parameters() -> None:
    from workbench.plan.cost.software import Software

    gpt = ModelConfig(name="175b", family="gpt2", n_layers=96, hidden=12288, n_heads=96,
                      n_kv_heads=96, ffn_hidden=49152, vocab=51200, seq_len=2048,
                      tie_embeddings=True)
    c = cluster_for("A100-SXM-80GB", 384)
    zero = Software(precision="fp16", flash_attention=False, dropout=True,
                    grad_reduce_bytes=2.0, dp_stack="deepspeed_zero3")
    fsdp = Software(**{**zero.__dict__, "dp_stack": "fsdp"})

    def step(mb: int, sw) -> float:
        lay = Layout(dp_shard=384, micro_batch=mb, grad_accum=1, recompute="full")
        return estimate(gpt, c, TrainConfig(global_batch=384 * mb), lay, software=sw).step_time_s

    assert step(1, zero) > 1.5 * step(1, fsdp)
    assert step(2, zero) < 1.2 * step(1, zero)  # gathers dominate: time ~ parameters, not mb


def test_fp8_scaling_and_async_tp_order() -> None:
    from workbench.plan.cost.software import Software

    lay = Layout(dp_shard=8, tp=8, sequence_parallel=True, micro_batch=4, grad_accum=1,
                 recompute="full")
    c = cluster_for("H100-SXM-80GB", 64)

    def step(**kw) -> float:
        return estimate(_big(), c, TrainConfig(global_batch=32), lay,
                        software=Software(compiled=True, **kw)).step_time_s

    bf16, tw = step(precision="bf16"), step(precision="fp8", fp8_scaling="tensorwise")
    rw = step(precision="fp8", fp8_scaling="rowwise")
    assert tw < bf16 and tw < rw
    assert step(precision="bf16", async_tp=True) < bf16
    assert step(precision="bf16", overlap_tp=True) <= step(precision="bf16", async_tp=True)


def test_validate_reads_the_software_stack_from_the_row() -> None:
    """A row's Software is its stack's description with the typed facts it sets."""
    from workbench.plan.accuracy.published import row_software

    def sw(stack: str, precision: str, **facts: str):
        return row_software({"stack": stack, "precision": precision, **facts})

    z = sw("deepspeed", "FP16")
    assert z.dp_stack == "deepspeed_zero3" and z.overlap_dp
    assert sw("megatron_2021", "FP16").dp_stack == "fsdp"
    r = sw("torchtitan", "FP8 rowwise", fp8_scaling="rowwise", compiled="true", async_tp="true")
    assert r.fp8_scaling == "rowwise" and r.async_tp and not r.overlap_tp and r.compiled
    assert sw("torchtitan", "FP8 linears").fp8_scaling == "tensorwise"
    m = sw("megatron", "BF16")
    assert m.overlap_tp and m.dist_optimizer and not m.async_tp and not m.eager
    # PyTorch FSDP without compile runs eager ops; torchao Float8 implies compile
    e = sw("torchtitan", "BF16")
    assert e.eager and not e.compiled
    f8 = sw("torchtitan", "FP8 linears")
    assert f8.compiled and not f8.eager
    assert not sw("torchtitan", "BF16", compiled="1").eager


def test_eager_elementwise_costs_more_than_fused_and_sp_follows_tp_comm_overlap() -> None:
    from dataclasses import replace

    from workbench.plan.accuracy.predict import default_csv, predict_case, read_rows
    from workbench.plan.accuracy.published import row_case, row_software

    _, rows = read_rows(default_csv()) if default_csv().is_file() else (None, [])
    model = ModelConfig(name="m", family="llama", n_layers=4, hidden=1024, n_heads=8,
                        n_kv_heads=8, ffn_hidden=4096, vocab=32000, seq_len=2048)
    cl, lay = cluster_for("H100-SXM-80GB", 8), Layout(dp_shard=8, micro_batch=1)
    from workbench.plan.cost.software import Software

    fused = estimate(model, cl, TrainConfig(), lay, software=Software())
    eager = estimate(model, cl, TrainConfig(), lay, software=replace(Software(), eager=True))
    comp = estimate(model, cl, TrainConfig(), lay, software=replace(Software(), compiled=True))
    assert comp.step_time_s < fused.step_time_s < eager.step_time_s
    for row in rows:
        if row["tp"] and int(row["tp"]) > 1 and row_software(row).overlap_tp:
            case = row_case(row)
            assert case.layout.sequence_parallel
            assert predict_case(case).step_time_s > 0



def test_pipeline_with_fsdp_keeps_the_stage_unsharded() -> None:
    """torch.distributed.pipelining turns FSDP2's resharding and gradient sync off until the
    last micro-batch: the stage's bf16 weights and fp32 gradient accumulators (6 bytes per
    stage parameter) stay allocated, where a replicated stage needs no gather buffer."""
    m = _big()
    c = cluster_for("H100-SXM-80GB", 8)
    train = TrainConfig(global_batch=16, micro_batch=1, dtype="bf16")

    def buffers(**degrees) -> float:
        lay = Layout(pp=2, micro_batch=1, grad_accum=16 // (4 * 1), **degrees)
        return estimate(m, c, train, lay).mem_bytes["mem_buffers_bytes"]

    stage_block_params = m.n_layers // 2 * model_shape(m).mean_layer_params()
    extra = buffers(dp_shard=4) - buffers(dp_replicate=4)
    assert extra >= 6 * stage_block_params


def test_fsdp_traffic_is_per_micro_batch_alone_and_per_step_in_a_pipeline() -> None:
    """Its time follows its memory: alone, FSDP gathers and reduce-scatters every micro-batch
    (time grows with grad_accum); in a pipeline the stage stays gathered and reduces once
    (time independent of it). The engine's measured bytes say the same (test_parallel.py,
    test_parallel_4ranks.py)."""
    m, c = _big(), cluster_for("H100-SXM-80GB", 8)

    def dp_s(pp: int, ga: int) -> float:
        lay = Layout(dp_shard=8 // pp, pp=pp, micro_batch=1, grad_accum=ga)
        train = TrainConfig(global_batch=lay.global_batch, micro_batch=1, dtype="bf16")
        e = estimate(m, c, train, lay)
        return e.time_s["time_dp_comm_exposed_s"] + e.dp_comm_overlapped_s

    assert dp_s(1, 8) == pytest.approx(2 * dp_s(1, 4), rel=1e-9)
    assert dp_s(2, 8) == pytest.approx(dp_s(2, 4), rel=1e-9)
    assert dp_s(2, 8) < dp_s(1, 8) / 4


def test_this_engines_pipeline_sends_whole_activations_without_sp() -> None:
    """Without SP every TP rank of this engine's stage sends the whole replicated output
    (test_parallel_4ranks.py measures it); with SP its 1/tp sequence shard."""
    m, c = _big(), cluster_for("H100-SXM-80GB", 8)

    def p2p_s(sp: bool) -> float:
        lay = Layout(tp=4, pp=2, sequence_parallel=sp, micro_batch=16, grad_accum=8)
        train = TrainConfig(global_batch=128, micro_batch=16, dtype="bf16")
        return estimate(m, c, train, lay).time_s["time_pp_p2p_s"]

    assert 3.8 < p2p_s(False) / p2p_s(True) <= 4.0  # 4x the bytes, the same latency


def test_this_engines_tp_backward_reduces_each_projection() -> None:
    """Without SP this engine all-reduces the input gradient of q, k, v, gate and up one by one
    (5 a layer, 2 forward), where Megatron's fused QKV and gate-up linears need 2 (and 2)."""
    from workbench.plan.cost.stacks import software_for

    m, c = _big(), cluster_for("H100-SXM-80GB", 8)
    lay = Layout(tp=8, micro_batch=1, grad_accum=8)
    train = TrainConfig(global_batch=8, micro_batch=1, dtype="bf16")
    engine = software_for(train, c)
    megatron = replace(engine, separate_qkv=False, separate_gate_up=False)
    assert engine.tp_bwd_allreduces(gated_mlp=True) == 5
    assert engine.tp_bwd_allreduces(gated_mlp=False) == 4

    def tp_s(sw: Software) -> float:
        return estimate(m, c, train, lay, software=sw).time_s["time_tp_comm_s"]

    assert tp_s(engine) == pytest.approx(tp_s(megatron) * (2 + 5) / (2 + 2), rel=1e-9)


def test_batch_first_sequence_parallel_pays_a_relayout_copy() -> None:
    """SP on dim 1 of (batch, seq, hidden) activations copies each gathered / scattered tensor
    once when a micro-batch holds several sequences; one sequence, Megatron's sequence-first
    layout, or async TP's fused kernels do not."""
    from workbench.plan.cost.software import Software

    c = cluster_for("H100-SXM-80GB", 8)

    def tp_s(mb: int, **sw) -> float:
        lay = Layout(tp=8, sequence_parallel=True, micro_batch=mb, grad_accum=16 // mb)
        t = TrainConfig(global_batch=16, micro_batch=mb, dtype="bf16")
        return estimate(_big(), c, t, lay, software=Software(**sw)).time_s["time_tp_comm_s"]

    assert tp_s(2, batch_first_sp=True) > tp_s(2)
    assert tp_s(1, batch_first_sp=True) == tp_s(1)
    assert tp_s(2, batch_first_sp=True, async_tp=True) == tp_s(2, async_tp=True)
