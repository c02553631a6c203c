"""The training stacks: one description per stack, used both to score published rows
(workbench.plan.accuracy.published reads a row's `stack` column) and to plan
(`python -m workbench.plan --stack NAME`).

A user who will run Megatron-Core or torchtitan wants the layout that is fastest there, not in
this engine: the stacks differ in what they overlap, shard and fuse (Megatron-Core hides TP
collectives behind GEMMs and shards only optimizer states; torchtitan shards everything with
FSDP2 and runs eager elementwise ops unless compiled). Each stack is its defaults as a
Software; a row or a plan that ran differently says so in typed facts
(workbench.plan.cost.stack_facts), never in free text. docs/planner.md ("Stack facts") has the
table of facts, their defaults per stack and their sources.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from workbench.config import ClusterConfig, TrainConfig, compute_dtype
from workbench.errors import ConfigError
from workbench.plan.cost.software import Software
from workbench.plan.cost.stack_facts import MEGATRON_LOSS_BYTES, FactValue, software_fields


@dataclass(frozen=True)
class Stack:
    """A stack's defaults and the rules that tie one of its facts to another.

    fp8_scaling: its FP8 recipe ("" = no FP8 path). fp8_compiles: FP8 turns on `compiled`
    (torchao's Float8 needs torch.compile to fuse its casts). eager_unless_compiled: elementwise
    ops run eager unless compiled (PyTorch without fused kernels). norm_eager_without_kernel:
    without its norm kernel the norm is eager ops that keep one more tensor. sp_with_tp: tensor
    parallelism always shards along the sequence (FSDP2 + TP). train_compile: the config's
    `train.compile` is its torch.compile switch. torchtitan_batching: what a row does not print
    of its batch is torchtitan's default (published._batching)."""

    about: str
    software: Software = field(default_factory=Software)
    fp8_scaling: str = ""
    fp8_compiles: bool = False
    eager_unless_compiled: bool = False
    norm_eager_without_kernel: bool = False
    sp_with_tp: bool = False
    train_compile: bool = False
    torchtitan_batching: bool = False


# FP16-era Megatron-LM / DeepSpeed (2021-22): no fused attention, dropout, FP16 gradients on the
# wire; Megatron's own training script not overlapping its gradient all-reduce.
_FP16_ERA = Software(precision="fp16", flash_attention=False, dropout=True, overlap_dp=False,
                     grad_reduce_bytes=2.0, cp_shards_params=False)

STACKS: dict[str, Stack] = {
    "workbench": Stack(
        "this repository's engine (FSDP2/DDP, TP, all-gather CP, pipelining)",
        Software(cp_allgather=True, batch_first_sp=True, p2p_tp_split=False, p2p_overlap=True,
                 separate_qkv=True, separate_gate_up=True), train_compile=True),
    # Megatron-LM forces fp32 gradient accumulation under bf16 (arguments.py) and NeMo's Apex
    # optimizer syncs in fp32 unless told otherwise; --tp-comm-overlap needs SP.
    "megatron": Stack(
        "Megatron-LM / Megatron-Core / NeMo with Transformer Engine: distributed optimizer, TP "
        "comm overlap (with SP), fp32 gradient buffer, ring CP, TE FP8",
        Software(overlap_tp=True, dist_optimizer=True, cp_shards_params=False,
                 grad_buffer_bytes=4.0), fp8_scaling="te_delayed"),
    "megatron_2021": Stack(
        "Megatron-LM's own training script, FP16 era (SC21, Korthikanti et al. 2022): no fused "
        "attention, dropout, FP16 gradient all-reduce not overlapped, unfused vocab-parallel "
        "cross-entropy",
        replace(_FP16_ERA, loss_hbm_bytes_per_logit=MEGATRON_LOSS_BYTES)),
    "deepspeed": Stack(
        "DeepSpeed ZeRO-3 as SC21 Table 2 compared it (2021, FP16): flat per-parameter gathers "
        "prefetched and overlapped, no fused attention, dropout",
        replace(_FP16_ERA, overlap_dp=True, dp_stack="deepspeed_zero3", cp_shards_params=True)),
    "torchtitan": Stack(
        "torchtitan: FSDP2 over dp x cp, SP with TP, eager elementwise ops unless compiled, "
        "torchao FP8 (compiled)",
        Software(batch_first_sp=True, cp_shards_params=True), fp8_scaling="tensorwise",
        fp8_compiles=True, eager_unless_compiled=True, sp_with_tp=True, train_compile=True,
        torchtitan_batching=True),
    "meta_llama3": Stack(
        "Meta's Llama 3 training stack as its paper describes it (section 3.3.2): sharded "
        "optimizer and gradients, CP by one all-gather of K/V per layer",
        Software(dist_optimizer=True, cp_allgather=True, cp_shards_params=False)),
    "aleph_alpha_scaling": Stack(
        "Aleph Alpha's scaling codebase (Hagemann et al. 2023): ZeRO-1 that all-reduces fp32 "
        "gradients in the optimizer step, separate SwiGLU gate/up linears, gathered logits, "
        "eager SwiGLU/RoPE, an RMSNorm kernel, blocking whole-tensor pipeline sends",
        Software(overlap_dp=False, grad_reduce_bytes=4.0, dist_optimizer=True, eager=True,
                 norm_kernel=True, cp_shards_params=False, grad_buffer_bytes=2.0,
                 zero1_allreduce=True, separate_gate_up=True, gathered_logits=True,
                 unfused_swiglu=True, attention_copies=True, p2p_tp_split=False,
                 p2p_blocking=True),
        norm_eager_without_kernel=True),
    # MosaicML llm-foundry (Composer FSDP), described from its code and yamls only (repository
    # mosaicml/llm-foundry): scripts/train/yamls/pretrain/mpt-*.yaml `fsdp_config`
    # (sharding_strategy FULL_SHARD over every GPU, limit_all_gathers); Composer's FSDP
    # mixed_precision DEFAULT (param_dtype bf16, reduce_dtype fp32: fp32 gradients on the wire,
    # fp32 sharded master weights and Adam states), backward prefetch (overlapped DP); no
    # torch.compile; attn_impl flash (flash-attn 2 at HEAD; rows benchmarked with flash-attn
    # 1.0.x or its Triton kernel say attention_kernel=flash1); MPT blocks (models/layers/
    # blocks.py, ffn.py) whose elementwise ops are single PyTorch kernels each
    # (low_precision_layernorm is one F.layer_norm, nn.GELU, residual adds; no RoPE, no
    # SwiGLU, no multi-op eager chain); dropout 0 (configuration_mpt.py); fused cross-entropy
    # (flash-attention's xentropy kernel, modeling_mpt.py `fused_crossentropy`).
    "mosaicml": Stack(
        "MosaicML llm-foundry (Composer FSDP FULL_SHARD, mixed precision DEFAULT: bf16 compute, "
        "fp32 gradient reduce and master weights), flash attention, no torch.compile",
        Software(overlap_dp=True, grad_reduce_bytes=4.0)),
}


def stack_of(name: str, key: str = "stack") -> Stack:
    """The registered stack `name`; ConfigError naming `key` and the stacks there are."""
    if name not in STACKS:
        raise ConfigError(key, name, "one of " + ", ".join(STACKS))
    return STACKS[name]


def describe(name: str, precision: str, facts: Mapping[str, FactValue] | None = None,
             key: str = "stack") -> Software:
    """The Software of stack `name` computing in `precision` (fp32 | bf16 | fp16 | fp8), with
    the software facts in `facts` overriding its defaults (layout facts are ignored here).
    ConfigError for an unknown stack or FP8 on a stack without an FP8 path."""
    stack, facts = stack_of(name, key), dict(facts or {})
    sw = replace(stack.software, precision=precision)
    if precision == "fp8":
        if not stack.fp8_scaling:
            with_fp8 = ", ".join(n for n, s in STACKS.items() if s.fp8_scaling)
            raise ConfigError("precision", "fp8", f"stack {name} has no FP8 path; stacks with "
                                                  f"one: {with_fp8}")
        sw = replace(sw, fp8_scaling=stack.fp8_scaling,
                     compiled=sw.compiled or stack.fp8_compiles)
    sw = replace(sw, **software_fields(facts))
    if stack.eager_unless_compiled and "eager_elementwise" not in facts:
        sw = replace(sw, eager=not sw.compiled)
    if stack.norm_eager_without_kernel:
        sw = replace(sw, unfused_norm=not sw.norm_kernel)
    return sw


def software_for(train: TrainConfig, cluster: ClusterConfig) -> Software:
    """The stack this repository trains with: fused attention, no dropout, overlapped DP,
    all-gather context parallelism, in the dtype a run on this cluster computes in (`auto`: bf16
    on cuda, fp32 on cpu). Its TP plan has a column-parallel linear per projection, each
    all-reducing its input gradient without SP, and its pipeline sends a stage's output as the
    plan leaves it: the sequence shard under SP, else the whole tensor from every TP rank,
    asynchronously (Software.p2p_overlap)."""
    return describe("workbench", compute_dtype(train, cluster),
                    {"compiled": bool(getattr(train, "compile", False))})


def stack_software(stack: str, train: TrainConfig, cluster: ClusterConfig, fp8: bool = False,
                   facts: Mapping[str, FactValue] | None = None) -> Software:
    """The Software `--stack NAME [--fp8] [--stack-fact KEY=VALUE ...]` plans for: the same
    description as the rows of that stack are scored with. This engine computes in its
    cluster's dtype, the others in bf16 (or FP8 linears); ConfigError for an unknown stack or
    FP8 on a stack without an FP8 path (a plan for it would be a plan for nothing)."""
    spec = stack_of(stack, "--stack")
    if fp8 and not spec.fp8_scaling:
        with_fp8 = " or ".join(n for n, s in STACKS.items() if s.fp8_scaling)
        raise ConfigError("--fp8", True, f"with --stack {with_fp8} (stack {stack} has no FP8 "
                                         "path)")
    facts = dict(facts or {})
    if spec.train_compile and getattr(train, "compile", False) and "compiled" not in facts:
        facts["compiled"] = True
    precision = "fp8" if fp8 else compute_dtype(train, cluster) if stack == "workbench" \
        else "bf16"
    return describe(stack, precision, facts, "--stack")
