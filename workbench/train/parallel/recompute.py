"""The per-block parallelism steps that need no mesh, shared by both engines: activation
checkpointing (recompute) and torch.compile, applied block by block in place."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workbench.train.model import Transformer

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
# Every fused kernel SDPA may dispatch to (flash, memory-efficient, cuDNN on recent GPUs, the
# CPU flash path, ...), read from the dispatcher so that a backend SDPA picks is never missed;
# the math fallbacks decompose into ops that are redone.
FUSED_ATTENTION = tuple(getattr(torch.ops.aten, name).default for name in dir(torch.ops.aten)
                        if name.startswith("_scaled_dot_product_")
                        and not name.endswith("_backward") and "math" not in name)
# Kept whole by the op policy: the attention core (its forward is the costliest op to redo)
# and the reductions (redoing one would send its bytes again; an SP all-gather is redone).
_ALWAYS_SAVED = (*FUSED_ATTENTION, torch.ops._c10d_functional.all_reduce.default,
                 torch.ops._c10d_functional.reduce_scatter_tensor.default)


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation checkpointing: `full` recomputes every block in backward; `selective`
    recomputes every other block (odd global index, so pipeline stages agree), halving
    activation memory for half the recompute. With fused attention there is no s*s tensor for
    Korthikanti's attention-core recompute to drop, so selective means this (torchtitan's layer
    policy with frequency 2), and the cost model (plan/cost/stages.py) models exactly this.
    `selective_op` checkpoints every block but keeps some op outputs (op_policy): the
    backward redoes the cheap elementwise ops and every second matmul, not the attention."""
    if mode == "none":
        return
    for key, block in model.layers.items():
        if mode == "selective_op":
            block.forward = _checkpointed(block.forward, op_contexts)
        elif mode == "full" or int(key) % 2 == 1:
            block.forward = _checkpointed(block.forward)


def op_policy(counts: dict[bool, int], ctx: Any, op: Any, *args: Any, **kwargs: Any
              ) -> CheckpointPolicy:
    """Save the attention core, the reductions and the 1st, 3rd, ... matmul of the block's
    forward (for a Llama block q, v, w1, w2: k, o and w3 are redone), recompute the rest.
    This is the trade torchtitan's `selective_ac_option = "op"` makes: the matmuls left to
    redo are about a third of the block's GEMM FLOPs, the saved outputs under half of what an
    unrecomputed block keeps. The count restarts in the recompute pass (ctx.is_recompute), so
    both passes pick the same matmuls."""
    if op in _MATMULS:
        counts[ctx.is_recompute] += 1
        odd = counts[ctx.is_recompute] % 2 == 1
        return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
    if op in _ALWAYS_SAVED:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def op_contexts() -> Any:
    """Fresh forward / recompute contexts for one checkpointed block call."""
    return create_selective_checkpoint_contexts(partial(op_policy, {False: 0, True: 0}))


def _checkpointed(fn: Callable[..., Any], context_fn: Callable[[], Any] | None = None
                  ) -> Callable[..., Any]:
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

    return wrapper


def apply_compile(model: Transformer) -> None:
    """Compile block by block in place (Module.compile keeps parameter names for checkpoints,
    and a block replaced later, by low-rank factorization, is recompiled on its next call)."""
    for block in model.layers.values():
        block.compile()


def apply_block_steps(model: Transformer, recompute: str, compile_blocks: bool) -> None:
    """Recompute, then compile: the order parallelize uses (after TP, before FSDP)."""
    apply_recompute(model, recompute)
    if compile_blocks:
        apply_compile(model)
