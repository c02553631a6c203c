"""The per-block parallelism steps that need no mesh, shared by both engines: activation
checkpointing (recompute) and torch.compile, applied block by block in place."""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.checkpoint import checkpoint

from workbench.train.model import Transformer


def apply_recompute(model: Transformer, mode: str) -> None:
    """Activation checkpointing: `full` recomputes every block in backward; `selective`
    recomputes every other block (odd global index, so pipeline stages agree), halving
    activation memory for half the recompute. With fused attention there is no s*s tensor for
    Korthikanti's attention-core recompute to drop, so selective means this (torchtitan's layer
    policy with frequency 2), and the cost model (plan/terms.py) models exactly this."""
    if mode == "none":
        return
    for key, block in model.layers.items():
        if mode == "full" or int(key) % 2 == 1:
            block.forward = _checkpointed(block.forward)


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

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
