"""The training stacks the planner plans for: this repository's engine, and the two published
stacks its cost model is scored against (benchmarks/costmodel_accuracy.py).

A user who will run Megatron-Core or torchtitan wants the layout that is fastest there, not in
this engine: the stacks differ in what they overlap, shard and fuse (Megatron-Core hides TP
collectives behind GEMMs and shards only optimizer states; torchtitan shards everything with
FSDP2 and runs eager elementwise ops unless compiled). Each stack here is the Software that
workbench.plan.accuracy.published reads from that stack's published rows, so the planner prices
a layout the way the calibration scored those rows (tests/test_plan_stacks.py holds them equal).
"""

from __future__ import annotations

from dataclasses import replace

from workbench.config import ClusterConfig, TrainConfig, compute_dtype
from workbench.errors import ConfigError
from workbench.plan.cost.software import Software

# name -> what it is and the calibration sources that score it (README, SOURCES.md)
STACKS: dict[str, str] = {
    "workbench": "this repository's engine (FSDP2/DDP, TP, all-gather CP, pipelining)",
    "megatron": "Megatron-Core / NeMo with Transformer Engine: distributed optimizer, TP comm "
                "overlap with SP, fp32 gradient buffer, ring CP (scored: dgxc_nemo2409, "
                "nemo2407, megatron_h100)",
    "torchtitan": "torchtitan: FSDP2 over dp x cp, eager elementwise ops unless "
                  "train.compile, torchao FP8 compiled (scored: torchtitan_2412, "
                  "torchtitan_asynctp, torchtitan_h200)",
}


def software_for(train: TrainConfig, cluster: ClusterConfig) -> Software:
    """The stack this repository trains with: fused attention, no dropout, overlapped DP,
    all-gather context parallelism, in the dtype a run on this cluster computes in (`auto`: bf16
    on cuda, fp32 on cpu). Its TP plan has a column-parallel linear per projection, each
    all-reducing its input gradient without SP, and its pipeline sends a stage's output as the
    plan leaves it: the sequence shard under SP, else the whole tensor from every TP rank,
    asynchronously (Software.p2p_overlap)."""
    return Software(precision=compute_dtype(train, cluster),
                    compiled=bool(getattr(train, "compile", False)), cp_allgather=True,
                    batch_first_sp=True, p2p_tp_split=False, p2p_overlap=True,
                    separate_qkv=True, separate_gate_up=True)


def stack_software(stack: str, train: TrainConfig, cluster: ClusterConfig,
                   fp8: bool = False) -> Software:
    """The Software of `stack`, in bf16 or with FP8 linears; ConfigError for an unknown stack
    or FP8 on this engine (it has no FP8 path, so a plan for it would be a plan for nothing)."""
    if stack not in STACKS:
        raise ConfigError("--stack", stack, ", ".join(STACKS))
    if stack == "workbench":
        if fp8:
            raise ConfigError("--fp8", True, "with --stack megatron or torchtitan (this "
                                             "engine trains in fp32 or bf16)")
        return software_for(train, cluster)
    precision = "fp8" if fp8 else "bf16"
    if stack == "megatron":
        # Megatron-LM forces fp32 gradient accumulation under bf16 (arguments.py), and NeMo's
        # Apex optimizer syncs in fp32 unless told otherwise; --tp-comm-overlap needs SP.
        sw = Software(precision=precision, overlap_tp=True, dist_optimizer=True,
                      cp_shards_params=False, grad_buffer_bytes=4.0)
        return replace(sw, fp8_scaling="te_delayed") if fp8 else sw
    # torchtitan: torchao's Float8 needs torch.compile to fuse its casts (torchao docs)
    compiled = bool(train.compile) or fp8
    return replace(Software(precision=precision), compiled=compiled, eager=not compiled,
                   batch_first_sp=True, cp_shards_params=True)
