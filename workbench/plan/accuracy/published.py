"""A published training run's row as typed planner inputs.

Rows come in the schema of benchmarks/calibration/published_layouts.csv: a model's dimensions, a
loosely named GPU, the degrees, and free text (precision, notes, zero_or_fsdp, interconnect)
that says what the stack did. This module reads that text into a Layout, a ClusterConfig and a
Software, so that a row from any source is estimated on the same footing as a planned layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from workbench.config import ClusterConfig, ModelConfig, TrainConfig
from workbench.errors import ConfigError
from workbench.layout import Layout, parse_split
from workbench.plan.accuracy.fabric import inter_node_gbps_per_gpu
from workbench.plan.cost.hardware import cluster_for
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.search.rules import engine_only, validate_layout

REQUIRED = ("n_layers", "hidden", "n_heads", "seq_len", "gpu_type", "n_gpus", "tp", "pp", "dp")
# Megatron's unfused vocab-parallel cross-entropy: HBM bytes per logit, forward + backward
# (counted op by op in Software.loss_hbm_bytes_per_logit).
MEGATRON_LOSS_BYTES = 52.0


@dataclass(frozen=True)
class Case:
    """One published row as typed planner inputs."""

    model: ModelConfig
    cluster: ClusterConfig
    train: TrainConfig
    layout: Layout
    software: Software



def _int(row: dict[str, str], key: str, default: int | None = None) -> int:
    text = (row.get(key) or "").strip()
    if not text:
        if default is None:
            raise ValueError(f"missing {key}")
        return default
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a number") from None


def _software(precision: str, notes: str, shard: str = "") -> Software:
    """FP16-era rows (Megatron 2021-22) ran without fused attention, with dropout, with grads
    reduced in FP16 and not overlapped; BF16/FP8 rows are the modern flash-attention stacks.
    The sharding stack comes from zero_or_fsdp (DeepSpeed ZeRO-3 prefetches its gathers), FP8
    scaling from the precision text (torchao's default recipe is tensorwise), CP load balancing
    is assumed unless the notes say otherwise."""
    p, n = precision.upper(), notes.lower().replace(" ", "")
    up = shard.upper().replace(" ", "")
    zero3, torch_fsdp = "ZERO-3" in up or "ZERO3" in up, "FSDP" in up
    # PyTorch-FSDP stacks (torchtitan) run eager elementwise ops unless compiled; torchao Float8
    # needs torch.compile to fuse its amax/casts (torchao/torchtitan float8 docs), so their FP8
    # rows count as compiled. Megatron/TE rows keep their fused kernels (neither flag).
    compiled = "compile" in n or (torch_fsdp and "FP8" in p)
    facts = {"overlap_tp": "tp-comm-overlap" in n, "async_tp": "asynctp" in n,
             "dist_optimizer": "overlap-param-gather" in n or "ZERO-1" in up, "compiled": compiled,
             "eager": (torch_fsdp and not compiled) or "eager-elementwise" in n,
             "dp_stack": "deepspeed_zero3" if zero3 else "fsdp",
             "cp_load_balance": "noloadbalanc" not in n and "unbalanced" not in n,
             # K/V all-gathered once per layer (Llama 3 paper, section 3.3.2) instead of a ring
             "cp_allgather": "cpbyall-gather" in n,
             "flash_v1": "flash_attentionv1" in n,
             # torchtitan's Triton RMSNorm (`norm_type = "fused_rmsnorm"`) in an eager stack
             "norm_kernel": "fused-rmsnorm" in n,
             "batch_first_sp": torch_fsdp,
             # Megatron-Core / NeMo put CP ranks in the data-parallel group, not a shard group
             "cp_shards_params": torch_fsdp or zero3,
             # Megatron-Core's grad buffer is 16 bit unless told to accumulate in fp32
             "grad_buffer_bytes": 2.0 if "grad-buffer-bf16" in n else 4.0,
             # Megatron-LM's own training script (its --overlap-grad-reduce flag; 2021 FP16
             # rows): the unfused vocab-parallel cross-entropy, op by op (Software)
             "loss_hbm_bytes_per_logit": MEGATRON_LOSS_BYTES
             if "overlap-grad-reduce" in n or ("FP16" in p and not zero3) else 0.0}
    if "FP8" in p:
        return Software(precision="fp8", **facts, fsdp_fp8_gather="float8all-gather" in n,
                        fp8_scaling="rowwise" if "ROWWISE" in p else "te_delayed"
                        if "TE" in p.replace("(", " ").split() else "tensorwise")
    if "dp-sync-in-step" in n and "BF16" in p:  # grads all-reduced in fp32 in the optimizer step
        facts |= {"zero1_allreduce": True, "dist_optimizer": True,
                  "separate_gate_up": "separate-gate-up" in n,
                  "gathered_logits": "gathered-logits" in n,
                  # the Aleph Alpha stack (separate gate/up linears) keeps eager copies
                  "unfused_swiglu": "separate-gate-up" in n,
                  "attention_copies": "separate-gate-up" in n,
                  # ... and its pipeline sends whole tensors, blocking (Software.p2p_blocking)
                  "p2p_tp_split": "separate-gate-up" not in n,
                  "p2p_blocking": "separate-gate-up" in n,
                  "unfused_norm": "eager-elementwise" in n,
                  # its `kernel: torch` attention core, op by op (Software.eager_softmax_bytes)
                  "eager_softmax_bytes": (4.0 if "softmax-fp32" in n else 2.0)
                  if "kerneltorch" in n else 0.0,
                  # its SwiGLU and RoPE are eager with or without the RMS kernel (Software)
                  "eager": facts["eager"] or "separate-gate-up" in n,
                  "norm_kernel": "separate-gate-up" in n and "eager-elementwise" not in n,
                  "pp_group": int(m.group(1)) if (m := re.search(r"pp-group=(\d+)", n)) else 0}
        return Software(precision="bf16", flash_attention="noflash" not in n, overlap_dp=False,
                        grad_reduce_bytes=4.0, **facts)
    if "FP16" in p:
        return Software(precision="fp16", flash_attention=False, dropout=True, overlap_dp=zero3,
                        grad_reduce_bytes=2.0, **facts)
    if "FP32" in p and "BF16" not in p:
        return Software(precision="fp32", **facts)
    return Software(precision="bf16", flash_attention="noflash" not in n, **facts)


def _recompute(text: str) -> str:
    """The policy a row's recompute column names: torchtitan's "op" option (its 8B toml default;
    rows say "selective (op)" or "(per-op)") is the op policy, any other selective the layer one."""
    t = text.strip().lower()
    if t.startswith("full"):
        return "full"
    if t.startswith("sel"):
        return "selective_op" if re.search(r"\(\s*(per-)?op\b", t) else "selective"
    return "none"


def _untied(published: str, model: ModelConfig) -> bool:
    """Whether a GPT row's published parameter count ("1.7B", "462B") says the LM head is its
    own matrix: the untied count is nearer to it than the tied one (Megatron-LM's README
    table: 1.7B is 24 x 12h^2 + 2 x 131,072 h at h = 2,048, 1.75B; tied it would be 1.48B).
    Without a count a GPT row stays tied, Megatron's default."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([BT])\s*", published.upper())
    if not m:
        return False
    value = float(m.group(1)) * (1e12 if m.group(2) == "T" else 1e9)
    ms = model_shape(model)
    tied = ms.n_layers * ms.mean_layer_params() + ms.embed_params
    return abs(tied + ms.vocab * ms.hidden - value) < abs(tied - value)


def row_case(row: dict[str, str], coeff: dict[str, float] | None = None) -> Case:
    """Typed inputs for one row; ValueError / KeyError / ConfigError say why it cannot be."""
    for key in REQUIRED:
        if not (row.get(key) or "").strip():
            raise ValueError(f"missing {key}")
    n_kv = (row.get("n_kv_heads") or "").strip()
    hidden = _int(row, "hidden")
    model = ModelConfig(name=row.get("model") or "row", family="llama" if n_kv else "gpt2",
                        n_layers=_int(row, "n_layers"), hidden=hidden,
                        n_heads=_int(row, "n_heads"), n_kv_heads=_int(row, "n_kv_heads",
                                                                      _int(row, "n_heads")),
                        ffn_hidden=_int(row, "ffn_hidden", 4 * hidden),
                        vocab=_int(row, "vocab", 51200), seq_len=_int(row, "seq_len"),
                        tie_embeddings=not n_kv)
    if not n_kv and _untied(row.get("n_params") or "", model):
        model = ModelConfig(**{**model.__dict__, "tie_embeddings": False})
    n_gpus = _int(row, "n_gpus")
    cluster = cluster_for(row["gpu_type"], n_gpus, _int(row, "gpus_per_node", 8), coeff)
    nic = inter_node_gbps_per_gpu(row.get("interconnect") or "", cluster.gpus_per_node)
    if nic is not None:  # the source states its fabric (workbench.plan.fabric)
        cluster = replace(cluster, inter_node_gbps=nic)
    tp, pp, dp = _int(row, "tp"), _int(row, "pp"), _int(row, "dp")
    cpsp = (row.get("cp_or_sp") or "").upper()
    m = re.search(r"CP\s*=\s*(\d+)", cpsp)
    cp = int(m.group(1)) if m else 1
    shard = (row.get("zero_or_fsdp") or "").upper()
    # PyTorch FSDP2 + TP (torchtitan) always shards norms/residuals along the sequence, and
    # Megatron's --tp-comm-overlap refuses to run without --sequence-parallel (arguments.py).
    notes = (row.get("notes") or "").lower()
    sp = tp > 1 and (cpsp.startswith("SP") or "FSDP2" in shard or "tp-comm-overlap" in notes
                     or "sequence-parallel" in notes)
    mb, gb, v, split = _batching(row, dp, pp, _int(row, "n_layers"), "FSDP2" in shard)
    sched = "interleaved_1f1b" if v > 1 and pp > 1 else "1f1b"
    sharded = "FSDP" in shard or "ZERO-3" in shard or "ZERO3" in shard
    layout = Layout(dp_replicate=1 if sharded else dp, dp_shard=dp if sharded else 1, tp=tp,
                    pp=pp, cp=cp, sequence_parallel=sp, micro_batch=mb,
                    grad_accum=gb // (dp * mb), recompute=_recompute(row.get("recompute") or ""),
                    pp_schedule=sched, virtual_stages=v if pp > 1 else 1)
    if layout.pp > 1 and layout.grad_accum < layout.pp:
        layout = Layout(**{**layout.__dict__, "pp_schedule": "gpipe"})
    if split:  # the published run's own uneven split
        layout = Layout(**{**layout.__dict__, "stage_layers": split})
    try:
        validate_layout(layout, model, layout.world_size)
    except ConfigError as e:
        if not engine_only(e):
            raise
    if layout.world_size != n_gpus:
        raise ValueError(f"tp*pp*dp*cp={layout.world_size} != n_gpus {n_gpus}")
    train = TrainConfig(global_batch=gb, micro_batch=mb, dtype="bf16")
    return Case(model, cluster, train, layout, _software(row.get("precision") or "BF16",
                                                              row.get("notes") or "", shard))


def _batching(row: dict[str, str], dp: int, pp: int, n_layers: int, torchtitan: bool
              ) -> tuple[int, int, int, tuple[int, ...]]:
    """(micro_batch, global_batch, virtual_stages, stage_layers) of a row. What a torchtitan
    row (FSDP2) does not print is torchtitan's default at its 2024-12 benchmark commit
    (9dec370): the global batch is the printed local batch times the data-parallel degree; a
    pipeline splits a rank's batch into pp micro-batches (`pipeline_parallel_microbatches`
    unset); an interleaved schedule runs 2 stages a rank; without split points the layers go
    by `torchtitan_split`. Any other row with a pipeline must print its global batch."""
    notes = (row.get("notes") or "").lower()
    local = re.search(r"local batch (\d+)", notes) if torchtitan else None
    gb = _int(row, "global_batch", int(local.group(1)) * dp if local else 0)
    if not gb and pp > 1:
        raise ValueError("missing global_batch (the pipeline schedule depends on it)")
    mb = _int(row, "micro_batch", max(1, gb // (dp * pp)) if torchtitan and pp > 1 else 1)
    gb = gb or mb * dp  # pp == 1: one micro-batch per step
    if gb % (dp * mb):
        raise ValueError(f"global_batch {gb} is not a multiple of dp*micro_batch {dp * mb}")
    v = _int(row, "virtual_stages", 2 if torchtitan and "interleaved" in notes else 1)
    split_text = (row.get("stage_layers") or "").strip()
    if split_text:
        return mb, gb, v, parse_split(split_text)
    return mb, gb, v, torchtitan_split(n_layers, pp * v) if torchtitan and pp > 1 else ()


def torchtitan_split(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layers per stage as torchtitan (2024-12, `generate_split_points`) splits them when no
    split points are given: the first stage n // stages, each middle stage one more while the
    remainder lasts, the last stage what is left (126 layers in 16 stages: 7, 8 x 14, 7)."""
    base, extra = divmod(n_layers, n_stages)
    middle = [base + 1 if i < extra else base for i in range(n_stages - 2)]
    return (base, *middle, n_layers - base - sum(middle)) if n_stages > 1 else (n_layers,)
