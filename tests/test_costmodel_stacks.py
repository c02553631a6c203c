"""Software-stack facts the calibration rows state (their stack and typed fact columns), and
what each costs.

The numbers checked are the formulas' own consequences (ratios that follow from counting
collectives and buffers), so a change to a coefficient does not break them; a change to how a
fact is read from a row or to what it means does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import benchmark_module, published_layouts_csv

from workbench.config import ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.accuracy.predict import apply_facts, read_rows
from workbench.plan.accuracy.published import row_case, row_software, torchtitan_split
from workbench.plan.cost.activations import activation_bytes_per_token
from workbench.plan.cost.coefficients import coefficients
from workbench.plan.cost.columns import layout_columns
from workbench.plan.cost.estimate import Estimate, estimate, evaluate
from workbench.plan.cost.hardware import cluster_for, hardware_for
from workbench.plan.cost.memory import gather_bytes
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software

PROJECT_CALIBRATION = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration"

# Llama-1 13B layer shapes, as the hagemann2023 rows use them (their vocabulary is the stack's
# 128,000; the costs checked here do not depend on it)
MODEL = ModelConfig(name="13b", family="llama", n_layers=8, hidden=5120, n_heads=40,
                    n_kv_heads=40, ffn_hidden=13824, vocab=32000, seq_len=2048)


def _software(stack: str, precision: str = "BF16", **facts: str) -> Software:
    """The Software a row of `stack` with these fact columns is scored with."""
    return row_software({"stack": stack, "precision": precision, **facts})


def _est(lay: Layout, sw: Software, n: int) -> Estimate:
    train = TrainConfig(global_batch=lay.dp_replicate * lay.micro_batch * lay.grad_accum,
                        micro_batch=lay.micro_batch, dtype="bf16")
    return estimate(MODEL, cluster_for("A100-SXM-80GB", n), train, lay, software=sw)


def test_scaling_codebase_facts_are_its_stacks_defaults() -> None:
    sw = _software("aleph_alpha_scaling")
    assert sw.zero1_allreduce and sw.dist_optimizer and not sw.overlap_dp
    assert sw.grad_reduce_bytes == 4.0  # allreduce_tensor_in_float32
    assert sw.tp_bwd_allreduces(gated_mlp=True) == 3 and sw.gathered_logits
    plain = _software("megatron")
    assert not plain.zero1_allreduce and plain.tp_bwd_allreduces(gated_mlp=True) == 2
    assert not plain.gathered_logits and plain.overlap_dp


def test_gradient_sync_inside_the_optimizer_step_is_all_exposed() -> None:
    """An all-reduce (2x a reduce-scatter) in fp32 plus the weight gather, after the last
    backward: nothing overlaps, and it moves (2*4 + 2) / (2 + 2) times the bytes of Megatron's
    bf16 reduce-scatter + gather."""
    lay = Layout(dp_replicate=16, micro_batch=1, grad_accum=4)
    overlapped = Software(dist_optimizer=True, grad_reduce_bytes=2.0)
    in_step = replace(overlapped, zero1_allreduce=True, overlap_dp=False, grad_reduce_bytes=4.0)
    a, b = _est(lay, overlapped, 16), _est(lay, in_step, 16)
    assert b.dp_comm_overlapped_s == 0.0
    total_a = a.time_s["time_dp_comm_exposed_s"] + a.dp_comm_overlapped_s
    assert b.time_s["time_dp_comm_exposed_s"] == pytest.approx(total_a * 10 / 4, rel=0.02)


@pytest.mark.parametrize("sp", [False, True])
def test_separate_gate_and_up_projections_add_a_backward_all_reduce(sp: bool) -> None:
    """Without SP a layer's TP time is forward (2 all-reduces) + backward (2, or 3 when the
    SwiGLU gate and up projections are separate column-parallel linears): 5/4 of Megatron's.
    With SP the backward is reduce-scatters of the gathered inputs: no change."""
    lay = Layout(dp_replicate=2, tp=4, sequence_parallel=sp, micro_batch=1, grad_accum=2)
    two = _est(lay, Software(), 8).time_s["time_tp_comm_s"]
    three = _est(lay, Software(separate_gate_up=True), 8).time_s["time_tp_comm_s"]
    assert three == pytest.approx(two if sp else two * 5 / 4, rel=1e-9)


@pytest.mark.parametrize("pp, transfers", [(2, 2), (4, 4)])
def test_whole_tensor_blocking_pipeline_sends_cost_tp_times_the_transfers(pp: int,
                                                                          transfers: int) -> None:
    """Megatron sends 1/tp of a boundary activation per TP rank, send and receive posted
    together (2 transfers a micro-batch); the scaling codebase sends the whole tensor from every
    TP rank with blocking send/recv: 4 transfers on a middle stage, 2 where every stage is an
    end stage (pp 2). tp * transfers / 2 times the bytes on the critical path."""
    lay = Layout(dp_replicate=1, tp=4, pp=pp, micro_batch=1, grad_accum=4)
    sw = _software("aleph_alpha_scaling")
    assert not sw.p2p_tp_split and sw.p2p_blocking
    split = _est(lay, Software(), 4 * pp).time_s["time_pp_p2p_s"]
    whole = _est(lay, Software(p2p_tp_split=False, p2p_blocking=True), 4 * pp
                 ).time_s["time_pp_p2p_s"]
    bytes_ratio = lay.tp * transfers / 2
    # a fixed per-transfer latency (p2p_latency_s) keeps the ratio under the bytes' ratio
    assert 0 < split and bytes_ratio / 2 < whole / split <= bytes_ratio


def test_a_sequence_parallel_stage_sends_its_shard_even_whole_tensor_stacks() -> None:
    """Under sequence parallelism a stage's output is already split over the sequence on the TP
    ranks (the scaling code reduce-scatters every layer's output to its sequence shard), so each
    TP rank sends 1/tp of it: the whole-tensor stack then moves Megatron's bytes per transfer."""
    def p2p(sp: bool, split: bool) -> float:
        lay = Layout(dp_replicate=1, tp=4, pp=4, sequence_parallel=sp, micro_batch=1,
                     grad_accum=4)
        sw = Software(p2p_tp_split=split, p2p_blocking=True)
        return _est(lay, sw, 16).time_s["time_pp_p2p_s"]

    assert p2p(True, False) == pytest.approx(p2p(True, True), rel=1e-12)
    assert p2p(False, False) > 2 * p2p(True, False)


def test_gathered_logits_are_not_divided_by_tp() -> None:
    """A vocab-parallel loss holds 1/tp of the logits per rank; gathering them first holds the
    whole vocabulary on every rank, plus the gathered 16-bit copy (12 + 2 bytes per logit), and
    from the second micro-batch of a step on the previous one's copy still in the pipeline
    engine's output buffer ring (+ 2)."""
    def logits_gib(tp: int, gathered: bool, ga: int = 1) -> float:
        lay = Layout(dp_replicate=8 // tp, tp=tp, micro_batch=1, grad_accum=ga)
        e = _est(lay, Software(gathered_logits=gathered), 8)
        return e.mem_bytes["mem_buffers_bytes"]  # pp 1, no FSDP, no recompute: the logits

    assert logits_gib(4, False) == pytest.approx(logits_gib(1, False) / 4)
    assert logits_gib(4, True) == pytest.approx(logits_gib(1, False) * 14 / 12)
    assert logits_gib(4, True, ga=2) == pytest.approx(logits_gib(1, False) * 16 / 12)


def test_llama3_rows_state_allgather_cp_and_no_tp_overlap() -> None:
    """The Llama 3 paper (section 3.3.2) does context parallelism by all-gathering K/V, and
    publishes no TP communication overlap: its rows keep sequence parallelism but hide no TP
    collective."""
    rows = [r for r in read_rows(PROJECT_CALIBRATION / "frontier_layouts.csv")[1]
            if r["source_group"] == "llama3_paper"]
    assert len(rows) == 3
    for row in rows:
        case = row_case(row)
        assert case.software.cp_allgather and not case.software.overlap_tp
        assert case.layout.sequence_parallel



def test_nemo2407_rows_read_the_printed_batching_and_the_launcher_yaml() -> None:
    """NeMo 24.07's table prints GBS, MBS and VP, and the launcher recipes of that release say
    the rest: Megatron's distributed optimizer with Apex's default fp32 gradient sync, TE
    delayed-scaling FP8, sequence parallelism under TP, TP comm overlap only where the yaml sets
    it, Llama and Nemotron heads untied, GPT-3's tied."""
    rows = {(r["model"], r["n_gpus"]): r
            for r in read_rows(PROJECT_CALIBRATION / "frontier_layouts.csv")[1]
            if r["source_group"] == "nemo2407"}
    assert len(rows) == 11
    for row in rows.values():
        case = row_case(row)
        sw, lay = case.software, case.layout
        assert sw.precision == "fp8" and sw.fp8_scaling == "te_delayed"
        assert sw.dist_optimizer and sw.grad_buffer_bytes == 4.0
        assert sw.loss_hbm_bytes_per_logit == 0  # NeMo's loss: the generic count
        assert lay.micro_batch == int(row["micro_batch"])
        assert lay.dp * lay.micro_batch * lay.grad_accum == int(row["global_batch"])
        assert lay.sequence_parallel == (lay.tp > 1)
        assert case.model.vocab % (128 * lay.tp) == 0
        assert case.model.tie_embeddings == row["model"].startswith("GPT3")
    l70 = row_case(rows[("LLAMA2-70B", "64")]).layout
    assert (l70.tp, l70.pp, l70.virtual_stages, l70.pp_schedule) == (4, 4, 20, "interleaved_1f1b")
    assert row_case(rows[("LLAMA2-70B", "64")]).software.overlap_tp
    assert not row_case(rows[("GPT3-175B", "512")]).software.overlap_tp  # its yaml: off
    assert row_case(rows[("LLAMA3-8B", "8")]).layout.cp == 2



def test_megatron_loss_moves_52_bytes_per_logit_where_the_generic_count_has_24() -> None:
    """Megatron-LM rows (and its 2021 FP16 rows) count the unfused vocab-parallel loss op by
    op; the step grows by exactly the extra bytes over HBM on every micro-batch."""
    sw = _software("megatron", loss_kernel="megatron_unfused")
    assert sw.loss_hbm_bytes_per_logit == 52.0
    assert _software("megatron_2021", "FP16").loss_hbm_bytes_per_logit == 52.0
    assert _software("torchtitan").loss_hbm_bytes_per_logit == 0.0
    lay = Layout(dp_replicate=2, micro_batch=1, grad_accum=3)
    base, megatron = (_est(lay, replace(sw, loss_hbm_bytes_per_logit=b), 2) for b in (0.0, 52.0))
    cluster = cluster_for("A100-SXM-80GB", 2)
    co, hw = coefficients(cluster), hardware_for(cluster)
    generic = 3 * co.elem_traffic * 4.0  # forward once, backward twice
    hbm = hw.hbm_bw_bytes_per_s * co.hbm_eff
    extra = 3 * (52.0 - generic) * MODEL.seq_len * MODEL.vocab / hbm  # 3 micro-batches
    assert megatron.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-9)


def test_gpt_rows_untie_the_head_only_where_the_published_count_says_so() -> None:
    """Megatron-LM's README GPT-1.7B (24 x 2048, 131k vocabulary) is 1.75B untied, 1.48B tied;
    SC21's GPT-1.7B (24 x 2304, 51,200) is 1.65B tied, 1.77B untied; no count: tied."""
    row = {"model": "GPT-1.7B", "n_layers": "24", "hidden": "2048", "n_heads": "16",
           "vocab": "131072", "seq_len": "4096", "gpu_type": "H100 (80GB)", "n_gpus": "8",
           "tp": "1", "pp": "1", "dp": "8", "precision": "BF16", "n_params": "1.7B",
           "stack": "megatron"}
    assert not row_case(row).model.tie_embeddings
    assert row_case({**row, "hidden": "2304", "vocab": "51200"}).model.tie_embeddings
    assert row_case({**row, "n_params": ""}).model.tie_embeddings


def _sheet_batch_ratios(vocab: int | None) -> list[float]:
    """Per measured hagemann2023 row: the global batch its printed MFU x step time x GPUs
    implies (A100 312 TFLOP/s; 6 FLOPs per parameter, embedding and head included, plus
    12 x layers x hidden x seq for attention), over the row's global batch."""
    _, rows = read_rows(PROJECT_CALIBRATION / "hagemann2023_layouts.csv")
    out = []
    for r in rows:
        if r["outcome"] == "oom" or not r["value2"]:
            continue
        n_l, h, ffn, s = (int(r[k]) for k in ("n_layers", "hidden", "ffn_hidden", "seq_len"))
        v = vocab or int(r["vocab"])
        per_token = 6 * (n_l * (4 * h * h + 3 * h * ffn) + 2 * v * h) + 12 * n_l * h * s
        flops = float(r["value2"]) / 100 * 312e12 * int(r["n_gpus"]) * float(r["value"])
        out.append(flops / (s * per_token) / int(r["global_batch"]))
    return out


def test_hagemann_rows_carry_the_vocabulary_the_sheets_mfu_was_counted_with() -> None:
    """With the rows' 128,000 vocabulary (Aleph Alpha's 128k tokenizer) the sheets' MFU gives
    the global batch of 2,048 / 512 sequences to within 0.5% on 303 of 306 rows in all five
    sheets; with Llama's 32,000 it is 2-7% over, by an amount that varies with the model and
    sequence length as a 96,000-row difference of embedding and head would."""
    ratios = _sheet_batch_ratios(None)
    assert len(ratios) == 306
    assert sum(abs(x - 1) <= 0.005 for x in ratios) >= 303
    llama_vocab = sorted(_sheet_batch_ratios(32000))
    assert llama_vocab[len(llama_vocab) // 2] > 1.02


def test_an_rms_kernel_leaves_the_other_elementwise_ops_eager() -> None:
    """Aleph Alpha's RMS kernel replaces the norm only: SwiGLU (`silu(x) * gate`) and RoPE stay
    eager, so its rows pay the eager factor on the TP-split ops and not on the norms, and their
    forward lies between the fused stack's and the all-eager one's."""
    rms = _software("aleph_alpha_scaling")
    no_kernel = _software("aleph_alpha_scaling", norm_kernel="false")
    assert rms.eager and rms.norm_kernel and not rms.unfused_norm
    assert no_kernel.eager and not no_kernel.norm_kernel and no_kernel.unfused_norm
    assert not _software("megatron").eager
    lay = Layout(dp_replicate=2, tp=4, micro_batch=1, grad_accum=2)

    def fwd(sw: Software) -> float:
        return _est(lay, sw, 8).time_s["time_fwd_s"]

    assert fwd(Software()) < fwd(Software(eager=True, norm_kernel=True)) \
        < fwd(Software(eager=True))


TORCHTITAN_405B = {"source_group": "t", "model": "Llama3.1-405B", "n_layers": "126",
                   "hidden": "16384", "n_heads": "128", "n_kv_heads": "8",
                   "ffn_hidden": "53248", "vocab": "128256", "seq_len": "8192",
                   "gpu_type": "H100 96GB HBM2e (500W, Grand Teton)", "n_gpus": "512",
                   "gpus_per_node": "8", "tp": "8", "pp": "8", "dp": "8",
                   "zero_or_fsdp": "FSDP2 (full shard)", "precision": "FP8 linears",
                   "recompute": "full", "global_batch": "256", "stack": "torchtitan",
                   "compiled": "true", "async_tp": "true", "local_batch": "32",
                   "notes": "3D 1F1B; compile+Float8+AsyncTP; local batch 32"}


def test_torchtitan_rows_take_torchtitans_pipeline_defaults_where_they_print_none() -> None:
    """torchtitan at its 2024-12 benchmark commit splits a rank's batch into pp micro-batches,
    splits 126 layers first/last-light over its stages (2 a rank when interleaved: the row's
    virtual_stages); the global batch of a row that gives only the local one (local_batch) is
    local x dp. A row that prints a value keeps it, and a pipeline row of another stack still
    needs its global batch."""
    one = row_case(TORCHTITAN_405B).layout
    assert (one.micro_batch, one.grad_accum, one.pp_schedule) == (4, 8, "1f1b")
    assert one.stage_layers == (15, 16, 16, 16, 16, 16, 16, 15)
    inter = row_case({**TORCHTITAN_405B, "virtual_stages": "2"}).layout
    assert (inter.virtual_stages, inter.pp_schedule) == (2, "interleaved_1f1b")
    assert inter.stage_layers == (7,) + (8,) * 14 + (7,)
    cp = row_case({**TORCHTITAN_405B, "global_batch": "", "dp": "4", "cp_or_sp": "CP=2",
                   "seq_len": "65536", "local_batch": "8"})
    assert (cp.train.global_batch, cp.layout.micro_batch, cp.layout.grad_accum) == (32, 1, 8)
    printed = row_case({**TORCHTITAN_405B, "micro_batch": "1", "virtual_stages": "1"}).layout
    assert (printed.micro_batch, printed.grad_accum) == (1, 32)
    megatron = {**TORCHTITAN_405B, "stack": "megatron", "zero_or_fsdp": "distributed optimizer",
                "global_batch": "", "local_batch": "", "precision": "BF16"}
    with pytest.raises(ValueError, match="global_batch"):
        row_case(megatron)
    for n, stages in ((126, 16), (126, 8), (80, 6), (10, 4), (32, 4)):
        split = torchtitan_split(n, stages)
        assert len(split) == stages and sum(split) == n and min(split) >= 1


def test_found_facts_fill_only_what_a_shared_row_leaves_empty() -> None:
    """A fact found about a shared row (its fabric, from the run's own scripts) fills an empty
    field and never overwrites a printed one, a typed stack fact as any other column; every
    shipped fact names a row it fills and its evidence."""
    key = {"source_group": "s", "model": "M", "gpu_type": "A100 80GB", "precision": "BF16"}
    fabric = {**key, "column": "interconnect", "value": "4x100Gb/s EFA per node",
              "evidence": "e"}
    kernel = {**key, "column": "norm_kernel", "value": "true", "evidence": "e"}
    rows = [{**key, "interconnect": "", "norm_kernel": ""},
            {**key, "interconnect": "8x200Gb/s HDR per node", "norm_kernel": "false"},
            {**key, "model": "N", "interconnect": ""}]
    out, filled = apply_facts(rows, [fabric, kernel])
    assert filled == 2 and out[0]["interconnect"] == fabric["value"]
    assert out[0]["norm_kernel"] == "true" and out[1]["norm_kernel"] == "false"
    assert out[1]["interconnect"] == "8x200Gb/s HDR per node" and out[2] == rows[2]
    assert apply_facts(out, [kernel])[1] == 0
    assert rows[0]["interconnect"] == ""  # the caller's rows are not changed
    shared = published_layouts_csv()
    accuracy = benchmark_module("costmodel_accuracy")
    facts = accuracy.read_rows_loose(accuracy.FACTS_CSV)[1]
    published = read_rows(shared)[1]
    for f in facts:
        assert apply_facts(published, [f])[1] >= 1, f"fact matches no shared row: {f}"
        assert f["evidence"].strip()
    found = {r["model"] + r["precision"]: row_case(r)
             for r in apply_facts(published, facts)[0] if r["source_group"] == "torchtitan_old"}
    # 4 x 100 Gb/s over 8 GPUs, as fabric.py reads it; the kernel and gather as typed facts
    assert found["Llama3-70BBF16"].cluster.inter_node_gbps == pytest.approx(6.25)
    assert found["Llama3-8BBF16"].software.norm_kernel
    assert found["Llama3.1-405BFP8 linears"].software.fsdp_fp8_gather
    assert not found["Llama3.1-405BBF16"].software.fsdp_fp8_gather


def test_fsdp_float8_all_gather_sends_the_block_linears_in_one_byte() -> None:
    """torchao's float8 all-gather under FSDP2: the gathers move one byte per linear weight
    and the working width for the rest; the fp32 reduce-scatter is unchanged, so the FSDP
    traffic shrinks by exactly that byte count, and only for FP8 linears."""
    model = replace(MODEL, vocab=128256, n_layers=8)
    lay = Layout(dp_replicate=1, dp_shard=16, tp=1, pp=1, cp=1, micro_batch=1, grad_accum=1)
    cluster = cluster_for("H100-SXM-80GB", 16)
    base = Software(precision="fp8", compiled=True)

    def fsdp_seconds(sw: Software) -> float:
        t = evaluate(model_shape(model), hardware_for(cluster), coefficients(cluster), sw,
                     layout_columns([lay]))
        return float(t["time_dp_comm_exposed_s"][0] + t["time_dp_comm_overlapped_s"][0])

    ms = model_shape(model)
    whole, block = gather_bytes(ms, replace(base, fsdp_fp8_gather=True), 2.0)
    linear = ms.mean_layer_matmul_params() / ms.mean_layer_params()
    assert block == pytest.approx(linear + 2.0 * (1 - linear)) and 1.0 < block < whole < 2.0
    ratio = fsdp_seconds(replace(base, fsdp_fp8_gather=True)) / fsdp_seconds(base)
    assert ratio == pytest.approx((2 * whole + 4.0) / (2 * 2.0 + 4.0), rel=0.02)
    bf16 = replace(base, precision="bf16")
    assert fsdp_seconds(replace(bf16, fsdp_fp8_gather=True)) == fsdp_seconds(bf16)
    assert gather_bytes(ms, base, 2.0) == (2.0, 2.0)
    assert _software("torchtitan", "FP8 linears", fsdp_fp8_gather="true").fsdp_fp8_gather
    assert not _software("torchtitan", "FP8 linears").fsdp_fp8_gather


def test_te_fp8_linears_keep_the_fp8_cast_of_their_inputs() -> None:
    """Transformer Engine (v1.8 module/linear.py, layernorm_linear.py) saves an FP8 linear's
    input as its one-byte cast: the QKV and MLP inputs (norm outputs) and the down projection's
    input keep 1 byte instead of 2, and the output projection keeps an FP8 copy beside the
    attention output the fused core keeps. It goes in the memory-only item ('unfused'), which
    no time term reads; torchao's FP8 (tensorwise, rowwise) is not TE's and keeps 16 bits."""
    ms = model_shape(MODEL)
    tp, sp = np.array([2.0]), np.array([1.0])
    bf16 = activation_bytes_per_token(ms, Software(precision="bf16"), tp, sp)
    te = activation_bytes_per_token(ms, Software(precision="fp8", fp8_scaling="te_delayed"),
                                    tp, sp)
    torchao = activation_bytes_per_token(ms, Software(precision="fp8"), tp, sp)
    for k in bf16:
        assert float(torchao[k][0]) == float(bf16[k][0])
        want = -2 * ms.hidden / 2 + (ms.q_width - ms.ffn_hidden) / 2 if k == "unfused" else 0.0
        assert float(te[k][0] - bf16[k][0]) == pytest.approx(want)
    lay = Layout(dp_replicate=4, tp=2, sequence_parallel=True, micro_batch=1, grad_accum=2)
    te_est, ao_est = (_est(lay, Software(precision="fp8", fp8_scaling=s), 8)
                      for s in ("te_delayed", "tensorwise"))
    assert te_est.mem_bytes["mem_activations_bytes"] < ao_est.mem_bytes["mem_activations_bytes"]
