"""PowerSGD (Vogels et al. 2019) as a DDP comm hook whose state survives a restart bitwise, and
the loop hooks that register it on the engine's replicated modules.

PyTorch's `powerSGD_hook` keeps its state (error feedback, warm-started Q matrices) per DDP
bucket index, as flat tensors in that bucket's layout. DDP builds its buckets twice: in
registration order for the first iteration, then again from the order gradients became ready.
A resumed run is in its first iteration again, with the other layout, so the saved state no
longer lines up (shape errors, or silently misplaced error feedback). Here the state lives per
parameter name and is laid out into whatever bucket the hook is given, before PyTorch's hook
runs (only when a bucket's parameters differ from the last time that index was seen), and
read back after it as views: the arithmetic is PyTorch's, per tensor, so the result does not
depend on how parameters are grouped into buckets.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from workbench import compat
from workbench.errors import ConfigError
from workbench.lowrank.saved import KEY, saved_state
from workbench.train.hooks import HookContext, LoopHooks


class PowerSGD:
    """One replicated module's PowerSGD: PyTorch's state object plus per-parameter error and Q;
    registered with `hook` as the module's comm hook (over `group`, its replication group)."""

    def __init__(self, module: nn.Module, group: Any, rank: int, start_iter: int, seed: int):
        self.state = psgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        # per bucket index: the parameter names PyTorch's state is laid out for, and their Qs
        self._buckets: dict[int, tuple[list[str], list[tuple[str, int, int]]]] = {}

    def _q_layout(self, names: list[str], grads: list[torch.Tensor]) -> list[tuple[str, int, int]]:
        """(name, Q length, P length) of the compressed tensors, in the order the hook packs
        them: grouped by shape (first appearance), bucket order inside a group."""
        st = self.state
        by_shape: dict[tuple, list] = defaultdict(list)
        for name, g in zip(names, grads):
            n, m = g.shape[0], g.numel() // max(g.shape[0], 1)
            r = min(n, m, st.matrix_approximation_rank)
            if compat.powersgd_should_compress()(n, m, r, st.min_compression_rate)[0]:
                by_shape[(n, m)].append((name, m * r, n * r))
        return [item for group in by_shape.values() for item in group]

    def run(self, bucket: Any) -> torch.futures.Future:
        st, idx = self.state, bucket.index()
        names = [self.names[id(p)] for p in bucket.parameters()]
        grads = bucket.gradients()
        seen = self._buckets.get(idx)
        if seen is not None and seen[0] == names:
            layout = seen[1]
        else:  # a new bucket layout (or a resumed run)
            layout = self._q_layout(names, grads)
            self._buckets[idx] = (names, layout)
            for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
                d.pop(idx, None)
            if names and all(n in self.error for n in names):
                st.error_dict[idx] = torch.cat([self.error[n] for n in names])
            if layout and all(n in self.q for n, _, _ in layout):
                st.q_memory_dict[idx] = torch.cat([self.q[n] for n, _, _ in layout])
                st.p_memory_dict[idx] = grads[0].new_empty(sum(p for _, _, p in layout))
        # The hook chains several all-reduces through future callbacks; with more than one
        # bucket, one bucket's callbacks and the next bucket's all-reduce can reach gloo in a
        # different order on each rank (a collective mismatch). Waiting keeps every rank's
        # order identical; on the CPU there is no compute to overlap with anyway. Each wait
        # stops the backward until every rank has arrived, so the engine gives replication one
        # bucket for PowerSGD on CPU ranks (parallelize.ddp_bucket_cap_mb): one such stop per
        # step, not one per 25 MB of gradients.
        fut = psgd.powerSGD_hook(st, bucket)
        fut.wait()
        if idx in st.error_dict:
            self.error.update(zip(names, st.error_dict[idx].split([g.numel() for g in grads])))
        if idx in st.q_memory_dict:
            self.q.update(zip([n for n, _, _ in layout],
                              st.q_memory_dict[idx].split([q for _, q, _ in layout])))
        return fut

    def state_dict(self) -> dict[str, Any]:
        """This rank's error feedback and Q per parameter, the RNG that draws fresh Qs, and
        the iteration count (the error feedback differs between ranks)."""
        return {"iter": self.state.iter, "rng": self.state.rng.get_state(),
                "error": {n: t.clone() for n, t in self.error.items()},
                "q": {n: t.clone() for n, t in self.q.items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.iter = saved["iter"]
        self.state.rng.set_state(saved["rng"])
        self.error, self.q = dict(saved["error"]), dict(saved["q"])
        self._buckets.clear()


def hook(state: PowerSGD, bucket):  # DDP checks annotations: none, or real types
    return state.run(bucket)


class PowerSGDHooks(LoopHooks):
    """`lowrank.mode=powersgd`: compress data-parallel gradients; the model stays dense. The
    hooks' state (each rank's error feedback and Qs) rides in every checkpoint."""

    def __init__(self, ctx: HookContext):
        self.ctx, self.lr = ctx, ctx.cfg.lowrank
        self.states: list[PowerSGD] = []

    def prepare(self, ckpt: Any) -> None:
        engine, lr, seed = self.ctx.engine, self.lr, self.ctx.cfg.train.seed
        self.states = engine.register_comm_hook(
            lambda module, group: PowerSGD(module, group, lr.powersgd_rank,
                                           max(2, lr.powersgd_start_iter), seed), hook)
        if not self.states:
            if engine.dp_size > 1:
                raise ConfigError("lowrank.mode", "powersgd",
                                  "PowerSGD is a DDP comm hook: use layout=ddp")
            print("warning: lowrank.mode=powersgd on one process: nothing to compress",
                  file=sys.stderr)
        state = saved_state(ckpt, "powersgd")
        for one, saved in zip(self.states, (state or {}).get("powersgd", [])):
            one.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return {KEY: {"mode": "powersgd", "powersgd": [s.state_dict() for s in self.states]}}
