"""Peak memory of one GPU of the fullest pipeline rank: weights, gradients and optimizer state
per parameter under each sharding, the activations the schedule keeps in flight, and the
buffers alive at the peak (logits and loss, FSDP's gathered weights, the re-materialized layer,
pipeline send/recv), with the allocator's fragmentation and the fixed CUDA/NCCL allowance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workbench.plan.cost.activations import loss_bytes_per_token
from workbench.plan.cost.coefficients import Coefficients
from workbench.plan.cost.columns import Schedule
from workbench.plan.cost.per_rank import Arrays, PerRank, PipeLayers
from workbench.plan.cost.shapes import ModelShape
from workbench.plan.cost.software import Software
from workbench.plan.cost.stages import Stage


def state_bytes_per_param(software: Software, shard_ranks: np.ndarray, reduce_ranks: np.ndarray,
                          weight_bytes: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, gradients, optimizer) bytes per parameter of one rank's model-parallel shard.

    FSDP (shard_ranks > 1) keeps fp32 weights, gradients and Adam m, v sharded (4 + 4 + 8 over
    the shard group). Unsharded: 16-bit working weights, a gradient buffer, and fp32 master + m
    + v (12; 8 in fp32, where the weights are the master). A distributed optimizer (Megatron-Core,
    NeMo's distributed fused Adam, ZeRO-1) shards only those 12 bytes over its data-parallel
    group (dp x cp in Megatron-Core): Megatron-LM docs/distrib_optimizer.md, 6 + 12/d bytes for
    bf16 weights with fp32 gradients, 4 + 12/d with 16-bit gradient buffers."""
    master = 8.0 if weight_bytes >= 4 else 12.0
    grad_full = max(software.grad_buffer_bytes, weight_bytes)
    opt_full = np.where(software.dist_optimizer, master / np.maximum(reduce_ranks, 1), master)
    sharded = shard_ranks > 1
    return (np.where(sharded, 4.0 / shard_ranks, weight_bytes),
            np.where(sharded, 4.0 / shard_ranks, grad_full),
            np.where(sharded, 8.0 / shard_ranks, opt_full))


def gather_bytes(shape: ModelShape, software: Software, weight_bytes: float
                 ) -> tuple[float, float]:
    """Bytes per parameter of an FSDP all-gather (and of the unsharded copy it fills): over
    the whole model, and over one block. The working weight's width, or under
    Software.fsdp_fp8_gather one byte for the block linears (norms, embedding and head stay
    at the working width)."""
    if not (software.fsdp_fp8_gather and software.precision == "fp8"):
        return weight_bytes, weight_bytes
    block, linear = shape.mean_layer_params(), shape.mean_layer_matmul_params()
    total = shape.n_layers * block + shape.embed_params + shape.head_params
    share = shape.n_layers * linear / total
    return share + (1.0 - share) * weight_bytes, (linear + (block - linear) * weight_bytes) / block


def inflight_per_layer(pp: np.ndarray, ga: np.ndarray, gpipe: np.ndarray,
                       interleaved: np.ndarray, virtual: np.ndarray, group: float = 0.0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches of activations per layer held at once on the first and the second rank:
    GPipe keeps all ga; 1F1B keeps pp - r on rank r; interleaved 1F1B keeps
    2 (pp - 1 - r) + (v - 1) N + 1 model-chunk activations on rank r (its warm-up forwards and
    the first steady-state one; Narayanan et al. 2021, Megatron-Core's
    get_pipeline_parallel_order / torch's ScheduleInterleaved1F1B), N the micro-batches a rank
    runs on one virtual stage before the next (`group`; 0: pp, both stacks' default; the Llama 3
    paper's schedule sets it freely, section 3.3.2). A rank never holds more than all its ga x v
    chunk forwards (Megatron caps the warm-up at the total), so a layer holds at most ga."""
    inter = interleaved & (pp > 1)
    group_size = np.where(group > 0, group, pp)
    chunks = 2 * (pp - 1) + (virtual - 1) * group_size + 1
    first = np.where(pp == 1, 1.0, np.where(gpipe, ga, np.where(
        inter, np.minimum(chunks / virtual, ga), np.minimum(pp, ga))))
    second = np.where(inter, np.minimum((chunks - 2) / virtual, ga),
                      np.where(gpipe, ga, np.minimum(pp - 1, ga)))
    return first, second


def rank_memory(pipe_layers: PipeLayers, pipe_params: PipeLayers, inflight: tuple[Any, ...],
                stored: np.ndarray, extra: tuple[Any, ...], buffer_per_param: np.ndarray,
                state: dict[str, np.ndarray], fixed_bytes: float, frag: float, pp: np.ndarray
                ) -> Arrays:
    """The memory terms of the fullest pipeline rank (first, a middle, last): `stored` bytes
    per layer and micro-batch times its layers and `inflight` micro-batches; `extra` bytes alive
    at its peak (logits on the last rank, the re-materialized layer); `buffer_per_param` buffer
    bytes per parameter it holds (FSDP's gathered weights); `state` bytes per parameter by term
    (weights, gradients, optimizer); a fragmentation allowance `frag` of its peak. `peak_rank`
    says which rank that is (0 first, 1 middle, 2 last), so its buffers can be itemized."""
    state_per_param = sum(state.values())
    choice: list[Any] = [pipe_layers[0], pipe_params[0], inflight[0], extra[0], 0.0]
    total = None
    for i, (present, *here) in enumerate(zip((pp > 0, pp > 2, pp > 1), pipe_layers, pipe_params,
                                             inflight, extra)):
        layers, params, micro_batches, extra_bytes = here
        bytes_here = np.where(present, params * (state_per_param + buffer_per_param * (1 + frag))
                              + (stored * layers * micro_batches + extra_bytes) * (1 + frag),
                              -np.inf)
        if total is not None:
            take = bytes_here > total
            choice = [np.where(take, new, old) for new, old in zip([*here, float(i)], choice)]
        total = bytes_here if total is None else np.maximum(total, bytes_here)
    layers, params, micro_batches, extra_bytes, which = choice
    acts = stored * layers * micro_batches
    peak = acts + extra_bytes + buffer_per_param * params
    return {**{k: params * b for k, b in state.items()}, "mem_activations_bytes": acts,
            "mem_buffers_bytes": peak - acts, "mem_fixed_bytes": fixed_bytes + frag * peak,
            "inflight_layers": layers * micro_batches, "peak_rank": which + 0.0 * acts}


def memory(shape: ModelShape, coeff: Coefficients, software: Software, rank: PerRank,
           stage: Stage) -> Arrays:
    """MEM_TERMS of one GPU of the fullest pipeline rank, their buffer parts (for --explain),
    and `inflight_layers` (layer activations the schedule keeps alive at once)."""
    cols, shards, tokens, act = rank.cols, rank.shard_ranks, rank.tokens, rank.activations
    elem_bytes, full_share, weight_bytes = software.act_bytes, rank.full_share, stage.weight_bytes
    tp, pp, ga = cols["tp"], cols["pp"], cols["ga"]
    param_b, grad_b, opt_b = state_bytes_per_param(software, shards, rank.reduce_ranks,
                                                   weight_bytes)
    kv_others = tokens * (cols["cp"] - 1) * 2 * shape.kv_width / tp * elem_bytes \
        if software.cp_allgather else 0.0
    # A compiled block (Inductor's min-cut partitioner) recomputes fused pointwise ops in the
    # backward instead of saving their outputs: the two norm outputs and the SwiGLU product.
    unsaved = (2 * act["input"] + elem_bytes * shape.ffn_hidden / tp * shape.gated_mlp) \
        if software.compiled else 0.0
    per_layer = tokens * (act["rep"] + act["split"] + act["unfused"]
                          + (1 - rank.core_recompute) * act["quad"]) + kv_others - tokens * unsaved
    full_layer = tokens * (act["rep"] + act["split"] + act["unfused"] + act["quad"]) + kv_others
    stored = tokens * (full_share * act["input"] + rank.op_policy * rank.op_kept_bytes) \
        + (1 - full_share - rank.op_policy) * per_layer
    # one layer re-materialized at a time (under the op policy, what it did not keep)
    working = np.where(full_share > 0, full_layer, rank.op_policy * np.maximum(
        full_layer - tokens * rank.op_kept_bytes, 0.0))
    inflight_first, inflight_middle = inflight_per_layer(
        pp, ga, cols["sched"] == Schedule.GPIPE, cols["sched"] == Schedule.INTERLEAVED_1F1B,
        rank.virtual, float(software.pp_group))
    logits = tokens * loss_bytes_per_token(shape.vocab, software, tp, ga)  # last stage
    # FSDP2 gathers one block at a time; inside a pipeline schedule it neither reshards after
    # forward nor syncs gradients until the last micro-batch (torch.distributed.pipelining sets
    # reshard_after_backward / requires_gradient_sync False), so the stage's unsharded weights
    # and fp32 gradient accumulators stay allocated for the whole step.
    gather_model, gather_block = gather_bytes(shape, software, weight_bytes)
    fsdp_per_param = np.where((shards > 1) & (pp > 1), gather_model + 4.0, 0.0)
    fsdp_flat = np.where((shards > 1) & (pp == 1), max(
        (2 * gather_block + 4.0) * stage.layer_params,
        (2 * weight_bytes + 4.0) * shape.vocab * float(shape.hidden)) / tp, 0.0)
    # Pipeline send/recv: one boundary activation in and one out (Megatron splits it over TP).
    p2p_buf = np.where(pp > 1, 2.0 * tokens * float(shape.hidden) * elem_bytes / tp, 0.0)
    logits_first = np.where(pp > 1, 0.0, logits)
    out = rank_memory(rank.pipe_layers, stage.pipe_params,
                      (inflight_first, inflight_middle, 1.0), stored,
                      (logits_first + fsdp_flat + working + p2p_buf, working + p2p_buf,
                       logits + working + p2p_buf), fsdp_per_param,
                      {"mem_params_bytes": param_b, "mem_grads_bytes": grad_b,
                       "mem_optimizer_bytes": opt_b}, coeff.mem_fixed_bytes, coeff.mem_frag, pp)
    peak_rank = out.pop("peak_rank")  # the parts of mem_buffers_bytes and mem_fixed_bytes
    logits_buf = np.where(peak_rank == 2, logits, np.where(peak_rank == 0, logits_first, 0.0))
    peak = out["mem_activations_bytes"] + out["mem_buffers_bytes"]
    return out | {"mem_buf_logits_bytes": logits_buf,
                  "mem_buf_fsdp_bytes": out["mem_buffers_bytes"] - logits_buf - working - p2p_buf,
                  "mem_buf_recompute_layer_bytes": working + 0.0 * tokens,
                  "mem_buf_p2p_bytes": p2p_buf, "mem_fragmentation_bytes": coeff.mem_frag * peak,
                  "mem_peak_rank": peak_rank}
