"""When to leave full rank, and the controller that does it inside the training loop.

`SwitchDetector` is pure arithmetic over stable-rank trajectories (unit-testable): each
layer's slope is smoothed by an EMA, and the layer is settled when the mean absolute smoothed
slope over the last `window` checks, relative to its stable rank at initialization, falls
below `epsilon`. Normalizing by the initial value makes one epsilon
fit a 128-wide and a 4096-wide layer, and a steady ramp keeps a constant slope, so it never
counts as settled (a relative-to-current slope would decay like 1/t and fire eventually).

`LowRankController` is what the loop calls: it measures stable ranks every `check_every`
steps, decides the switch on rank 0 (all ranks then apply the same rank map), converts the
engine's model (re-wrapping DDP/FSDP/TP from a full state dict), rebuilds the optimizer,
and carries its state in the checkpoint so a resume before or after the switch is exact.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from workbench.config import ConfigError, RunConfig
from workbench.train import lowrank as lr_mod
from workbench.train.detector import SwitchDetector, forced, should_switch

__all__ = ["SwitchDetector", "forced", "should_switch", "LowRankController", "make_controller"]


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _quiet(engine: Any):
    """Bookkeeping collectives are not the engine's traffic (comm.uncounted when counting)."""
    from contextlib import nullcontext

    counter = getattr(engine, "counter", None)
    if counter is not None and hasattr(counter, "uncounted"):
        return counter.uncounted()
    groups = getattr(engine, "groups", None)
    if groups is None:
        return nullcontext()
    from workbench.train import comm

    return comm.uncounted(groups)


def merged(engine: Any, local: dict[str, Any]) -> dict[str, Any]:
    """Every rank's dict merged (pipeline stages hold different layers)."""
    if not _dist_ready():
        return dict(local)
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    with _quiet(engine):
        dist.all_gather_object(out, local)
    merged_: dict[str, Any] = {}
    for d in out:
        merged_.update(d)
    return merged_


def from_rank0(engine: Any, obj: Any) -> Any:
    """Rank 0's value on every rank: one rank decides, all apply the same decision."""
    if not _dist_ready():
        return obj
    import torch.distributed as dist

    box = [obj]
    with _quiet(engine):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def model_of(engine: Any) -> torch.nn.Module:
    """The engine's module with global parameter names (the checkpoint view when parallel)."""
    return getattr(engine, "view", None) or engine.model


# ---------------------------------------------------------------------------- conversion
def convert_engine(engine: Any, cfg: RunConfig, rank_map: dict[str, int]) -> None:
    """Factorize the engine's model in place. One process: replace the modules. Several:
    gather the full state, build a fresh model, factorize it, and parallelize it again over
    the same mesh (DDP/FSDP2 cannot change their parameters under them)."""
    if not hasattr(engine, "view"):
        lr_mod.convert(engine.model, rank_map)
        if engine.forward is not engine.model:  # compiled: compile the new graph
            engine.forward = torch.compile(engine.model)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from workbench.train.dist_engine import ParallelEngine
    from workbench.train.model import build
    from workbench.train.parallelize import parallelize

    with _quiet(engine):
        full = get_model_state_dict(engine.view, options=StateDictOptions(full_state_dict=True))
        full = {k: v.detach().to("cpu") for k, v in full.items()}
        model = build(cfg.model, cfg.train.seed, "cpu")
        model.load_state_dict(full, strict=False)
        lr_mod.convert(model, rank_map)
        parts = parallelize(model, engine.mesh, engine.layout, cfg, engine.device)
    ParallelEngine.__init__(engine, parts, engine.mesh, engine.layout, cfg, engine.device)


def make_optimizer(engine: Any, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW as the loop builds it, except that low-rank factors get no weight decay (the
    controller applies Frobenius decay on their product instead)."""
    params = engine.parameters()
    factors = {id(p) for p in lr_mod.factor_params(model_of(engine))}
    t = cfg.train
    groups = [{"params": [p for p in params if p.requires_grad and p.dim() >= 2
                          and id(p) not in factors], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.requires_grad and p.dim() < 2],
               "weight_decay": 0.0},
              {"params": [p for p in params if id(p) in factors], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2),
                             fused=(engine.device.type == "cuda") or None)


@torch.no_grad()
def frobenius_decay(model: torch.nn.Module, coef: float) -> None:
    """Decoupled decay of ||U V||_F^2 / 2: U -= coef (U V) V^T, V -= coef U^T (U V).

    Weight decay on each factor would shrink U and V separately and push the pair to
    unbalanced scales; decaying their product regularizes the function the layer computes,
    as weight decay did on the dense layer (Pufferfish/Cuttlefish)."""
    if coef == 0:
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    for m in model.modules():
        if not isinstance(m, lr_mod.LowRankLinear):
            continue
        u, v = lr_mod.full_weight(m.u.weight), lr_mod.full_weight(m.v.weight)
        w = u @ v
        du, dv = coef * (w @ v.T), coef * (u.T @ w)
        for p, d in ((m.u.weight, du), (m.v.weight, dv)):
            if isinstance(p, DTensor):
                p.sub_(distribute_tensor(d, p.device_mesh, p.placements, src_data_rank=None))
            else:
                p.sub_(d)


def peek_state(ckpt: Any) -> dict[str, Any] | None:
    """The controller's state in the checkpoint the loop is about to resume from (the newest
    whole one), read before the model is built so that a post-switch checkpoint finds the
    factorized shapes it was written with."""
    for step in reversed(ckpt.steps()):
        if hasattr(ckpt, "verify"):  # one whole file
            if ckpt.verify(step) is not None:
                continue
            state = torch.load(ckpt.path(step), map_location="cpu", weights_only=False)
        else:  # sharded: the per-rank extras hold what is not sharded
            path = ckpt.path(step)
            mine = path / f"extra_rank{ckpt.rank:05d}.pt"
            state = torch.load(mine if mine.exists() else path / "extra_rank00000.pt",
                               map_location="cpu", weights_only=False)
        return state.get("lowrank")
    return None


class LowRankController:
    """The loop's low-rank hooks: prepare -> make_optimizer -> (lr_factor, after_step)* ->
    finish; state_dict goes into every checkpoint."""

    def __init__(self, cfg: RunConfig, engine: Any, tracker: Any, run_dir: str):
        self.cfg, self.lr, self.engine, self.tracker = cfg, cfg.lowrank, engine, tracker
        self.run_dir, self.mode = run_dir, cfg.lowrank.mode
        self.detector = SwitchDetector(self.lr.ema, self.lr.window, self.lr.epsilon)
        self.scales: dict[str, float] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        self.probes: dict[str, lr_mod.StableRankProbe] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.rank_map: dict[str, int] = {}
        self.switch_step: int | None = None  # first step trained at low rank
        self._trainable = 0
        self._pending: dict[str, float] = {}
        self._powersgd: list[Any] = []  # this rank's PowerSGD hook states, one per DDP module

    # --- set-up ---
    def prepare(self, ckpt: Any) -> None:
        """Before the optimizer exists: restore state (and factorized shapes) from the
        checkpoint being resumed, or measure stable ranks at initialization."""
        if self.mode == "powersgd":
            self._register_powersgd()
        state = peek_state(ckpt)
        if state is not None:
            self.load_state_dict(state)
            if self.switch_step is not None:
                convert_engine(self.engine, self.cfg, self.rank_map)
        elif self.mode in ("adaptive", "fixed"):
            srs = self._measure()
            self.scales = {n: min(self.shapes[n]) / max(sr, 1e-12) for n, sr in srs.items()}
            self.detector.observe(srs)
            self._record(0, srs)
        self._trainable = lr_mod.trainable_params(model_of(self.engine))

    def _register_powersgd(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from workbench.train.powersgd import PowerSGD

        ddps = [p for p in getattr(self.engine, "parts", []) if
                isinstance(p, DistributedDataParallel)]
        if not ddps:
            if getattr(self.engine, "dp_size", 1) > 1:
                raise ConfigError("lowrank.mode", "powersgd",
                                  "PowerSGD is a DDP comm hook: use layout=ddp")
            print("warning: lowrank.mode=powersgd on one process: nothing to compress",
                  file=sys.stderr)
            return
        for ddp in ddps:
            self._powersgd.append(PowerSGD(ddp, self.lr.powersgd_rank,
                                           max(2, self.lr.powersgd_start_iter),
                                           self.cfg.train.seed))

    def make_optimizer(self) -> torch.optim.Optimizer:
        return make_optimizer(self.engine, self.cfg)

    # --- per step ---
    def lr_factor(self, step: int) -> float:
        """After the switch: lr_rescale, ramped linearly over rewarm_steps (a reset Adam
        takes full-size first steps; the ramp keeps them from undoing what was learned)."""
        if self.switch_step is None or step < self.switch_step:
            return 1.0
        ramp = min(1.0, (step - self.switch_step + 1) / max(1, self.lr.rewarm_steps))
        return self.lr.lr_rescale * ramp

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, lr: float
                   ) -> tuple[torch.optim.Optimizer, dict[str, float]]:
        """Called after optimizer.step() of `step`; returns the optimizer to use from now on
        (a new one after the switch) and the metrics to log with this step."""
        metrics: dict[str, float] = {"params/trainable": float(self._trainable),
                                     **self._pending}
        self._pending = {}
        if self.switch_step is not None and self.lr.frobenius_decay > 0:
            frobenius_decay(model_of(self.engine), lr * self.lr.frobenius_decay)
        if self.mode not in ("adaptive", "fixed") or self.switch_step is not None:
            return optimizer, metrics
        total = self.cfg.train.steps
        srs: dict[str, float] = {}
        if self.mode == "fixed":
            go = step + 1 >= max(1, round(self.lr.switch_frac * total))
        else:
            if (step + 1) % self.lr.check_every == 0:
                srs = self._measure()
                self.detector.observe(srs)
                self._record(step + 1, srs)
                metrics.update({f"sr/{n}": v for n, v in srs.items()})
            go = ((step + 1) % self.lr.check_every == 0 or
                  forced(step, total, self.lr.max_switch_frac)) and \
                should_switch(self.detector, step, total, self.lr.min_switch_frac,
                              self.lr.max_switch_frac)
        if not from_rank0(self.engine, bool(go)):
            return optimizer, metrics
        if self.mode == "adaptive" and not srs:  # forced by max_switch_frac between checks
            srs = self._measure()
        layers = [lr_mod.LayerShape(n, *self.shapes[n]) for n in sorted(self.shapes)]
        rank_map = lr_mod.rank_map_for(self.mode, self.lr, layers, self.scales, srs)
        self.rank_map = from_rank0(self.engine, rank_map)
        self.switch_step = step + 1
        convert_engine(self.engine, self.cfg, self.rank_map)
        self._trainable = lr_mod.trainable_params(model_of(self.engine))
        metrics.update(self.switch_metrics())
        self._write_rank_map()
        return self.make_optimizer(), metrics

    def switch_metrics(self) -> dict[str, float]:
        out = {f"rank/{n}": float(r) for n, r in self.rank_map.items()}
        out["lowrank/switch_step"] = float(self.switch_step or 0)
        out["lowrank/switch_frac"] = float((self.switch_step or 0) / self.cfg.train.steps)
        out["params/trainable"] = float(self._trainable)
        return out

    # --- measurement ---
    def _measure(self) -> dict[str, float]:
        """Stable rank of every candidate layer, on every rank alike (merged over stages)."""
        model = model_of(self.engine)
        found = lr_mod.candidates(model, self.lr, self.cfg.model.n_layers)
        if not self.probes:
            self.probes = lr_mod.make_probes(lr_mod.shapes(found), self.cfg.train.seed)
        local: dict[str, tuple[float, int, int]] = {}
        for name, module in found:
            w = lr_mod.full_weight(module.weight)
            local[name] = (self.probes[name](w, self.lr.power_iters), *w.shape)
        everything = merged(self.engine, local)
        self.shapes = {n: (int(o), int(i)) for n, (_, o, i) in everything.items()}
        return {n: float(v[0]) for n, v in sorted(everything.items())}

    def _record(self, step: int, srs: dict[str, float]) -> None:
        for n, v in srs.items():
            self.history.setdefault(n, []).append((step, v))
        if step == 0:
            self._pending.update({f"sr/{n}": v for n, v in srs.items()})

    # --- artifacts ---
    def _write_rank_map(self) -> None:
        if not getattr(self.engine, "is_main", True) or not self.run_dir:
            return
        path = os.path.join(self.run_dir, "rank_map.json")
        body = {"mode": self.mode, "switch_step": self.switch_step,
                "total_steps": self.cfg.train.steps,
                "layers": {n: {"rank": r, "out": self.shapes[n][0], "in": self.shapes[n][1],
                               "scale": self.scales.get(n)}
                           for n, r in sorted(self.rank_map.items())},
                "dense": sorted(set(self.shapes) - set(self.rank_map))}
        with open(path, "w") as f:
            json.dump(body, f, indent=1)
        self.tracker.log_artifact(path, "lowrank")

    def finish(self) -> None:
        """The stable-rank plot (and the rank map again, for runs resumed after the switch)."""
        if not getattr(self.engine, "is_main", True) or not self.run_dir or not self.history:
            return
        path = os.path.join(self.run_dir, "stable_rank.png")
        lr_mod.plot_stable_ranks(self.history, self.switch_step, path)
        self.tracker.log_artifact(path, "lowrank")
        if self.switch_step is not None:
            self._write_rank_map()

    # --- checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scales": dict(self.scales), "shapes": dict(self.shapes),
                "probes": {n: p.state_dict() for n, p in self.probes.items()},
                "detector": self.detector.state_dict(),
                "history": {k: list(v) for k, v in self.history.items()},
                "rank_map": dict(self.rank_map), "switch_step": self.switch_step,
                "powersgd": [p.state_dict() for p in self._powersgd]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode", self.mode) != self.mode:
            raise ConfigError("lowrank.mode", self.mode,
                              f"the checkpoint was written with mode {state['mode']}")
        self.scales = dict(state["scales"])
        self.shapes = {k: tuple(v) for k, v in state["shapes"].items()}
        self.probes = {}
        for n, p in sorted(state["probes"].items()):
            probe = lr_mod.StableRankProbe(1, 0)
            probe.load_state_dict(p)
            self.probes[n] = probe
        self.detector.load_state_dict(state["detector"])
        self.history = {k: [tuple(x) for x in v] for k, v in state["history"].items()}
        self.rank_map = dict(state["rank_map"])
        self.switch_step = state["switch_step"]
        for hook, saved in zip(self._powersgd, state.get("powersgd", [])):
            hook.load_state_dict(saved)


def make_controller(cfg: RunConfig, engine: Any, tracker: Any,
                    run_dir: str) -> LowRankController:
    return LowRankController(cfg, engine, tracker, run_dir)
