"""What the training stack does, as far as cost goes: the facts of a code base the cost model
needs beside the model, the hardware and the coefficients (workbench.plan.cost.stacks describes
each stack as one of these: this repository's, and those of the published rows, whose `stack`
and fact columns workbench.plan.cost.stack_facts reads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Software:
    """What the training stack does, as far as cost goes (not a coefficient: a fact of the code).

    precision: fp32 | bf16 | fp16 | fp8 (fp8 = FP8 linears, BF16 elsewhere).
    flash_attention: fused attention (no s*s tensors stored or moved); Megatron 2021 had none.
    dropout: dropout masks are stored (GPT-era Megatron); Llama recipes train without dropout.
    overlap_dp: gradient reduction / FSDP gathers are overlapped with compute.
    grad_reduce_bytes: bytes per gradient element on the wire (fp32 reduce = 4, fp16 = 2).
    Parameters are sharded over dp_shard x cp (context-parallel ranks hold the same weights and
    reduce their gradients together, as torchtitan's dp_shard_cp mesh does).
    """

    precision: str = "bf16"
    flash_attention: bool = True
    dropout: bool = False
    overlap_dp: bool = True
    grad_reduce_bytes: float = 4.0
    overlap_tp: bool = False  # Megatron --tp-comm-overlap (TE userbuffers)
    async_tp: bool = False  # torchtitan async TP (SymmetricMemory micro-pipelining)
    # Megatron distributed optimizer with --overlap-param-gather: gradients reduce-scattered
    # (overlapping the last backward), parameters all-gathered in 16 bit (overlapping the next
    # forward) instead of one all-reduce.
    dist_optimizer: bool = False
    compiled: bool = False  # torch.compile / fused kernels: fewer elementwise HBM round trips
    # PyTorch eager elementwise ops (one kernel per op, FP32 upcasts in norms/RoPE); False: the
    # fused kernels of Megatron/Transformer Engine (or compiled, see above).
    eager: bool = False
    # With `eager`: the norms run as one fused kernel while the other elementwise ops stay
    # eager, so only the TP-split part (SiLU, gate multiply, RoPE) pays the eager factor. Aleph
    # Alpha scaling with its RMS kernel: the kernel replaces the RMSNorm only; nn/mlp.py
    # `_standard_siglu_forward` (`silu(x) * gate`) and nn/rotary.py (an fp32 complex multiply)
    # stay eager PyTorch whichever norm kernel runs.
    norm_kernel: bool = False
    # FP8 scaling granularity (torchao): "tensorwise" (one scale per tensor; the producer's
    # kernel fuses amax and cast, and TP all-gathers travel in FP8) or "rowwise" (one scale per
    # row: separate amax/cast kernels per operand and axis, TP all-gathers stay in BF16).
    # "te_delayed": Transformer Engine delayed scaling (Megatron-Core / NeMo; see
    # Coefficients.fp8_te_mm_speedup), TP all-gathers in BF16 unless TE's fp8_buf is set.
    fp8_scaling: str = "tensorwise"
    # With FP8 linears under FSDP2: torchao's float8 all-gather (torchtitan
    # `enable_fsdp_float8_all_gather`): the linear weights travel and sit unsharded in FP8 (one
    # byte), cast on the shard before the gather; norms, embedding and output head stay 16-bit.
    fsdp_fp8_gather: bool = False
    # Which implementation shards parameters over dp_shard: "fsdp" (PyTorch FSDP/FSDP2,
    # Megatron distributed optimizer: bucketed NCCL collectives over all NICs of a node, prefetch
    # one block ahead) or "deepspeed_zero3" (DeepSpeed ZeRO-3 as of 2021: flat per-parameter
    # gathers, see Coefficients.zero3_gather_eff).
    dp_stack: str = "fsdp"
    # Context parallel shards the sequence in 2*cp chunks, chunk i paired with 2*cp-1-i, so every
    # rank does the same causal work (torchtitan / Megatron-Core default); False: naive ring.
    cp_load_balance: bool = True
    # Context parallel by one all-gather of K/V per layer (Llama 3; this repository's engine,
    # train/parallel/context.py) instead of a ring: attention is one kernel over the whole
    # sequence, the gather (forward) and reduce-scatter of dK/dV (backward) are not overlapped,
    # and the gathered K/V of the other cp ranks stay stored for the backward.
    cp_allgather: bool = False
    # Activations laid out (batch, seq, hidden) with sequence parallel sharding dim 1
    # (torchtitan, this engine) rather than Megatron's sequence-first layout: with more than one
    # sequence per micro-batch, each all-gather's output and each reduce-scatter's input is
    # re-laid out by a full copy (torch.distributed._functional_collectives chunk + cat), unless
    # async TP's fused all-gather/reduce-scatter matmuls move the shards themselves.
    batch_first_sp: bool = False
    # Where context-parallel ranks sit for the weights: True (torchtitan's dp_shard_cp mesh, this
    # engine) shards parameters over dp_shard x cp like FSDP; False (Megatron-Core: the
    # data-parallel group "with CP" is dp x cp) keeps full weights on every CP rank and only
    # joins CP to the gradient reduction and the distributed optimizer's shard group.
    cp_shards_params: bool = True
    # Bytes per element of the unsharded buffer gradients accumulate in: fp32 main grads
    # (PyTorch DDP, Megatron 2021, Megatron-Core with --accumulate-allreduce-grads-in-fp32) or
    # the 16-bit parameter dtype (Megatron-Core's default grad buffer, NeMo's distributed
    # fused Adam with bf16 grad sync).
    grad_buffer_bytes: float = 4.0
    # A ZeRO-1 that all-reduces the full gradients (instead of reduce-scattering them) and then
    # all-gathers the updated 16-bit weights, both inside the optimizer step after the last
    # backward (Aleph Alpha's scaling codebase: optimizer.py `allreduce_gradients` ->
    # allreduce.py `allreduce_tensor_in_float32`, then `step_sequel`): 2x the reduce volume of
    # a reduce-scatter, in fp32 on the wire, and nothing overlapped (set overlap_dp False).
    zero1_allreduce: bool = False
    # Without sequence parallelism every column-parallel linear all-reduces its input gradient
    # in the backward (Megatron's copy_to_tensor_model_parallel_region), so a layer's backward
    # has one all-reduce per column-parallel linear (tp_bwd_allreduces). Megatron fuses QKV and
    # the MLP's gate+up projection: 2, as its forward. Aleph Alpha scaling keeps QKV fused but
    # the SwiGLU gate and up separate (nn/mlp.py ParallelSwiGLUMLP `dense_in` + `siglu_weight`):
    # 3. This engine's TP plan (torch ColwiseParallel per module, torchtitan-style) makes q, k,
    # v, gate and up each a linear that turns its replicated input into a DTensor of its own:
    # 3 + 2 a SwiGLU layer, 3 + 1 a GELU one (measured on gloo: tests/test_parallel.py).
    separate_qkv: bool = False
    separate_gate_up: bool = False
    # The LM head's vocab-parallel output is all-gathered to the full vocabulary on every TP
    # rank before an eager fp32 cross-entropy (Aleph Alpha scaling: transformer/model/layers/
    # lm_head.py ColumnParallelLinear with parallel_output False, losses/cross_entropy.py
    # `.float()`): the loss and its logits buffers are not divided by tp, and the gathered 16-bit
    # logits are alive beside the fp32 ones. False: a vocab-parallel loss (Megatron, torchtitan).
    gathered_logits: bool = False
    # SwiGLU as two eager ops, `silu(x) * gate` (Aleph Alpha scaling nn/mlp.py
    # `_standard_siglu_forward`): autograd keeps the silu input, the silu output and the gate
    # (and the down projection its input), 4 tensors of ffn width; a fused SwiGLU (Megatron
    # bias_swiglu, Transformer Engine) keeps 3.
    unfused_swiglu: bool = False
    # RMSNorm as eager ops (Aleph Alpha scaling nn/norm/rms_norm.py `_standard_forward`:
    # `x * rsqrt(mean(x^2) + eps)` then `* weight`): the weight's product keeps the normalized
    # tensor beside the norm's input; a fused norm kernel keeps the input and 1/rms only.
    unfused_norm: bool = False
    # Attention kept in eager layout copies (Aleph Alpha scaling nn/attention/attention.py with
    # its default `attention_qkv_in_one`): Q, K, V are views of one QKV matmul output, so the
    # whole output stays alive through V's view that flash attention saves; RoPE saves its
    # rotated Q and K as new tensors; and the attention output is re-laid out by a copy that
    # the output projection saves. 3 more tensors of the Q width than Q, K, V and the output.
    attention_copies: bool = False
    # Interleaved 1F1B: micro-batches a rank runs on one virtual stage before moving to the next
    # (N; 0 = pp, Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage default and
    # torch's ScheduleInterleaved1F1B). Smaller N holds fewer warm-up activations (Llama 3 paper
    # section 3.3.2 sets N freely; stages.inflight_per_layer).
    pp_group: int = 0
    # Pipeline boundary traffic. Megatron scatters each boundary activation over the TP group
    # (every TP rank sends 1/tp of it, all-gathered after the receive) and posts the send and
    # the receive of a pass together (batched isend/irecv): 2 transfers of tok*h/tp on the
    # critical path per micro-batch. torch.distributed.pipelining (this engine, torchtitan)
    # sends the stage output as the TP plan leaves it: replicated, whole, from every TP rank
    # unless SP shards it (p2p_tp_split False). Aleph Alpha scaling (nn/parallel_module/
    # communicator.py `PipeCommunicator`) also has every TP rank send the whole tensor, with
    # blocking torch.distributed.send / recv, one call after the other: 4 transfers of tok*h a
    # micro-batch on a middle stage (receive the input, send the output, receive the output's
    # gradient, send the input's gradient), none hidden. At pp 2 both stages are end stages
    # (pipeline_schedule/train.py: the first sends activations and receives gradients, the last
    # the reverse), so 2 transfers, not 4, are on the path of each micro-batch: an event
    # simulation of that instruction order with rendezvous send/recv gives 2.0 transfer times
    # per micro-batch slot at pp 2 and 3.7-3.8 at pp 4-8 (ga 64), and with free transfers the
    # 1F1B time (ga + pp - 1)(f + b) exactly. Under sequence parallelism either stack's stage
    # output is already split over the sequence on the TP ranks, so each sends its 1/tp shard.
    p2p_tp_split: bool = True
    p2p_blocking: bool = False
    # torch.distributed.pipelining (this engine) posts a micro-batch's sends and receives as
    # asynchronous p2p ops and waits for a receive only when its stage needs the tensor: in the
    # steady state a transfer runs while the rank computes the next micro-batch, so only one
    # micro-batch's transfers (the fill's and the drain's) and what a transfer takes beyond the
    # compute beside it are on the step's path.
    p2p_overlap: bool = False

    # FlashAttention 1.x kernels rather than FlashAttention-2 (Hagemann et al.'s
    # "flash_attentionv1.0.8" rows): see Coefficients.flash1_rel_speed.
    flash_v1: bool = False
    # HBM bytes per logit (on one TP rank) that the loss moves in forward + backward, where the
    # stack's loss code is known op by op; 0: the generic estimate (elementwise traffic on an
    # fp32 copy of the logits). Megatron's unfused vocab-parallel cross-entropy (megatron/core/
    # tensor_parallel/cross_entropy.py, the default without --cross-entropy-loss-fusion; the
    # same ops in the 2021 mpu version) runs one kernel per op on fp32 logits: `.float()`
    # (read 2, write 4), max (read 4), in-place subtract (8), exp in place (8), sum (read 4),
    # in-place divide to the saved softmax (8) = 38 forward; backward `mul_` by the incoming
    # gradient (8) and the cast back to the 16-bit logits' dtype (read 4, write 2) = 14: 52.
    loss_hbm_bytes_per_logit: float = 0.0
    # Without flash attention, the attention core as eager PyTorch ops with the softmax in this
    # many bytes (2 or 4: Aleph Alpha scaling's `kernel: torch`, `softmax_in_fp32`), counted op
    # by op (activations.EAGER_SOFTMAX_SCORE_BYTES); 0: the generic count (elementwise traffic
    # over the stored score tensors, as for a fused softmax kernel).
    eager_softmax_bytes: float = 0.0

    def loss_fwd_bytes_per_logit(self, elem_traffic: float) -> float:
        """HBM bytes per logit charged to the loss forward; the stage charges the backward
        twice that (stages.stage_times), so an op-by-op total is split a third / two thirds.
        Generic: `elem_traffic` round trips of an fp32 copy of the logits."""
        if self.loss_hbm_bytes_per_logit:
            return self.loss_hbm_bytes_per_logit / 3.0
        return elem_traffic * 4.0

    def tp_bwd_allreduces(self, gated_mlp: bool) -> int:
        """Input-gradient all-reduces a layer's backward runs without SP: one per
        column-parallel linear the stack keeps (QKV fused or q, k, v; the MLP's input
        projection, or a SwiGLU's gate and up apart)."""
        return (3 if self.separate_qkv else 1) + (2 if gated_mlp and self.separate_gate_up else 1)

    @property
    def act_bytes(self) -> float:
        return 4.0 if self.precision == "fp32" else 2.0
