"""A published training run's row as typed planner inputs.

Rows come in the schema of benchmarks/calibration/published_layouts.csv: a model's dimensions, a
loosely named GPU, the degrees, the training stack (`stack`, one of
workbench.plan.cost.stacks.STACKS) and the typed facts where the run differed from that stack's
defaults (workbench.plan.cost.stack_facts; docs/planner.md "Stack facts"). This module reads
them into a Layout, a ClusterConfig and a Software, so that a row from any source is estimated
on the same footing as a planned layout. The `notes` column is for people: nothing reads it.
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
from workbench.plan.cost.stack_facts import FactValue, facts_of
from workbench.plan.cost.stacks import STACKS, Stack, describe, stack_of
from workbench.plan.search.rules import engine_only, validate_layout

REQUIRED = ("n_layers", "hidden", "n_heads", "seq_len", "gpu_type", "n_gpus", "tp", "pp", "dp")


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


def row_precision(text: str) -> str:
    """The compute precision a row's precision column names: fp8 (FP8 linears), fp16 (also
    "FP16/BF16", the FP16-era rows that do not say), fp32, else bf16."""
    p = text.upper()
    if "FP8" in p:
        return "fp8"
    if "FP16" in p:
        return "fp16"
    return "fp32" if "FP32" in p and "BF16" not in p else "bf16"


def row_stack(row: dict[str, str], where: str = "") -> tuple[str, dict[str, FactValue]]:
    """A row's stack and the typed facts it sets against that stack's defaults (the `stack`
    column and the fact columns of workbench.plan.cost.stack_facts; `notes` is not read).
    ConfigError naming the column and what is valid for a missing or unknown stack or a bad
    fact value."""
    name = (row.get("stack") or "").strip()
    stack_of(name, "stack" + where)
    return name, facts_of(row, where)


def row_software(row: dict[str, str]) -> Software:
    """The Software a row ran: its stack's description in its precision, with its facts."""
    name, facts = row_stack(row)
    return describe(name, row_precision(row.get("precision") or "BF16"), facts)


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
    name, facts = row_stack(row)
    stack = STACKS[name]
    software = describe(name, row_precision(row.get("precision") or "BF16"), facts)
    sp = tp > 1 and bool(facts.get("sequence_parallel", _sp_default(cpsp, stack, software)))
    mb, gb, v, split = _batching(row, dp, pp, _int(row, "n_layers"), stack.torchtitan_batching,
                                 int(facts.get("local_batch", 0)))
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
    return Case(model, cluster, train, layout, software)


def _sp_default(cp_or_sp: str, stack: Stack, software: Software) -> bool:
    """Sequence parallelism where a row's sequence_parallel column is empty: its cp_or_sp
    column says SP; its stack always shards along the sequence under TP (PyTorch FSDP2 + TP,
    torchtitan); or it overlaps TP communication (Megatron's --tp-comm-overlap refuses to run
    without --sequence-parallel, arguments.py)."""
    return cp_or_sp.startswith("SP") or stack.sp_with_tp or software.overlap_tp


def _batching(row: dict[str, str], dp: int, pp: int, n_layers: int, torchtitan: bool,
              local_batch: int = 0) -> tuple[int, int, int, tuple[int, ...]]:
    """(micro_batch, global_batch, virtual_stages, stage_layers) of a row. Without a printed
    global batch it is the row's local_batch (sequences per data-parallel rank) times the
    data-parallel degree. What a torchtitan row does not print is torchtitan's default at its
    2024-12 benchmark commit (9dec370): a pipeline splits a rank's batch into pp micro-batches
    (`pipeline_parallel_microbatches` unset); without split points the layers go by
    `torchtitan_split` (an interleaved schedule's 2 stages a rank are its virtual_stages
    column). Any other row with a pipeline must print its global batch."""
    gb = _int(row, "global_batch", local_batch * dp)
    if not gb and pp > 1:
        raise ValueError("missing global_batch (the pipeline schedule depends on it)")
    mb = _int(row, "micro_batch", max(1, gb // (dp * pp)) if torchtitan and pp > 1 else 1)
    gb = gb or mb * dp  # pp == 1: one micro-batch per step
    if gb % (dp * mb):
        raise ValueError(f"global_batch {gb} is not a multiple of dp*micro_batch {dp * mb}")
    v = _int(row, "virtual_stages", 1)
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
