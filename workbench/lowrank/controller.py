"""The loop hook that trains at low rank: measures stable ranks, switches, and converts.

`LowRankController` overrides `LoopHooks`: it measures stable ranks every `check_every` steps,
decides the switch on rank 0 with `detector.SwitchDetector` (all ranks then apply the same rank
map), rebuilds the engine around a factorized copy of its model (`engine.rebuild`: the same
layout, DDP/FSDP/TP applied anew), makes a new optimizer, and carries its state in the
checkpoint so a resume before or after the switch is exact. Mode `powersgd` instead registers
a PowerSGD comm hook on the engine's DDP modules.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from workbench.config import RunConfig
from workbench.errors import ConfigError
from workbench.lowrank import factorize as lr_mod
from workbench.lowrank import signals as sig
from workbench.lowrank.detector import Criterion, SwitchDetector, forced, should_switch
from workbench.lowrank.plots import plot_signals, plot_stable_ranks
from workbench.lowrank.ranks import LayerShape, rank_map_for
from workbench.train.engine import Engine
from workbench.train.hooks import LoopHooks
from workbench.train.model import build, trainable_params
from workbench.train.optimizer import make_optimizer

KEY = "lowrank"  # the controller's entry in every checkpoint
COLUMNS = ("step", "sr", "rank", "energy_rank", "overlap", "rate")  # a history row


def criterion(cfg: RunConfig) -> Criterion:
    """The detector's thresholds: the config's, with warm-up as a share of training."""
    lr, t = cfg.lowrank, cfg.train
    return Criterion(threshold=lr.threshold, smooth_pct=lr.smooth_pct,
                     window_pct=lr.window_pct, warmup_pct=100.0 * t.warmup_steps / t.steps,
                     straggler_frac=lr.straggler_frac, straggler_relax=lr.straggler_relax)


def merged(engine: Engine, local: dict[str, Any]) -> dict[str, Any]:
    """Every rank's dict merged (pipeline stages hold different layers)."""
    out: dict[str, Any] = {}
    for d in engine.gather_objects(local):
        out.update(d)
    return out


def dense_params(cfg: RunConfig) -> int:
    """Trainable parameters of the whole dense model (every pipeline stage's, tied weights
    once): the base of lowrank.target_reduction. Built on the CPU: on the meta device the
    tied head and embedding come apart and would count twice."""
    return trainable_params(build(cfg.model, cfg.train.seed, "cpu"))


def convert_engine(engine: Engine, cfg: RunConfig, rank_map: dict[str, int]) -> None:
    """Factorize the engine's model: gather the full state, build a fresh model, factorize it,
    and rebuild the engine around it (DDP/FSDP2 cannot change their parameters under them)."""
    with engine.uncounted():
        full = engine.full_state_dict()
        model = build(cfg.model, cfg.train.seed, "cpu")
        model.load_state_dict(full, strict=False)  # a pipeline stage holds some layers
        lr_mod.convert(model, rank_map)
        engine.rebuild(model)


def dense_state(engine: Engine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state of every parameter, by name and with its shape, taken before
    the switch rebuilds the model (the parameter objects do not survive the rebuild)."""
    return {n: (tuple(p.shape), optimizer.state[p]) for n, p in engine.view.named_parameters()
            if p in optimizer.state}


def restore_dense_state(engine: Engine, optimizer: torch.optim.Optimizer,
                        kept: dict[str, Any]) -> None:
    """Give the parameters that stayed dense (same name and shape) their AdamW moments and
    step count back; only the new factors start from zero.

    Why: a fresh AdamW takes sign-like first steps of the full LR size on every parameter
    (m / sqrt(v) ~ 1 when both hold one gradient), which is what forced the re-warm after the
    switch; the embeddings, norms and the dense first/last blocks (about a third of the 14M
    model) lose nothing at the switch, so their moments still describe their gradients."""
    for n, p in engine.view.named_parameters():
        shape_state = kept.get(n)
        if shape_state is not None and shape_state[0] == tuple(p.shape):
            optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in shape_state[1].items()}


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


class LowRankController(LoopHooks):
    """The loop's low-rank hooks: prepare -> make_optimizer -> (lr_factor, after_step)* ->
    finish; its state goes into every checkpoint under `KEY`."""

    def __init__(self, cfg: RunConfig, engine: Engine, tracker: Any, run_dir: str):
        self.cfg, self.lr, self.engine, self.tracker = cfg, cfg.lowrank, engine, tracker
        self.run_dir, self.mode = run_dir, cfg.lowrank.mode
        self.detector = SwitchDetector(criterion(cfg))
        self.scales: dict[str, float] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        self.probes: dict[str, lr_mod.StableRankProbe] = {}
        self.signals: dict[str, sig.LayerSignals] = {}
        self.history: dict[str, list[list[float]]] = {}  # layer -> rows of COLUMNS
        self.rank_map: dict[str, int] = {}
        self.switch_step: int | None = None  # first step trained at low rank
        self.forced = False  # the switch came from max_switch_frac, not the detector
        self._trainable = 0
        self._pending: dict[str, float] = {}
        self._powersgd: list[Any] = []  # this rank's PowerSGD hook states, one per DDP module

    # --- set-up ---
    def prepare(self, ckpt: Any) -> None:
        """Before the optimizer exists: restore state (and factorized shapes) from the
        checkpoint being resumed, or measure stable ranks at initialization."""
        if self.mode == "powersgd":
            self._register_powersgd()
        state = ckpt.peek(KEY)
        if state is None and ckpt.steps():
            raise ConfigError("lowrank.mode", self.mode,
                              "the checkpoint was written with mode off")
        if state is not None:
            self.load_state_dict(state)
            if self.switch_step is not None:
                convert_engine(self.engine, self.cfg, self.rank_map)
        elif self.mode in ("adaptive", "fixed"):
            self._check(0)
        self._trainable = lr_mod.trainable_params(self.engine.view)

    def _register_powersgd(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from workbench.lowrank.powersgd import PowerSGD

        ddps = [p for p in self.engine.parts if isinstance(p, DistributedDataParallel)]
        if not ddps:
            if self.engine.dp_size > 1:
                raise ConfigError("lowrank.mode", "powersgd",
                                  "PowerSGD is a DDP comm hook: use layout=ddp")
            print("warning: lowrank.mode=powersgd on one process: nothing to compress",
                  file=sys.stderr)
            return
        for ddp in ddps:
            self._powersgd.append(PowerSGD(ddp, self.lr.powersgd_rank,
                                           max(2, self.lr.powersgd_start_iter),
                                           self.cfg.train.seed))

    def make_optimizer(self, engine: Engine, cfg: RunConfig) -> torch.optim.Optimizer:
        """AdamW as without hooks, except that low-rank factors get no weight decay (the
        controller applies Frobenius decay on their product instead)."""
        factors = {id(p) for p in lr_mod.factor_params(engine.view)}
        return make_optimizer(engine.parameters(), cfg, fused=engine.device.type == "cuda",
                              no_decay=factors)

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
            frobenius_decay(self.engine.view, lr * self.lr.frobenius_decay)
        if self.mode not in ("adaptive", "fixed") or self.switch_step is not None:
            return optimizer, metrics
        total = self.cfg.train.steps
        srs: dict[str, float] = {}
        if self.mode == "fixed":
            go = step + 1 >= max(1, round(self.lr.switch_frac * total))
        else:
            if (step + 1) % self.lr.check_every == 0:
                srs = self._check(step + 1)
                metrics.update(self._pending)
                self._pending = {}
            go = ((step + 1) % self.lr.check_every == 0 or
                  forced(step, total, self.lr.max_switch_frac)) and \
                should_switch(self.detector, step, total, self.cfg.train.warmup_steps,
                              self.lr.min_switch_frac, self.lr.max_switch_frac)
        if not self.engine.from_rank0(bool(go)):
            return optimizer, metrics
        self.forced = self.mode == "adaptive" and not self.detector.settled()
        if self.mode == "adaptive" and not srs:  # forced by max_switch_frac between checks
            srs = {n: v["sr"] for n, v in self._measure().items()}
        kept = dense_state(self.engine, optimizer) if self.lr.keep_dense_state else {}
        layers = [LayerShape(n, *self.shapes[n]) for n in sorted(self.shapes)]
        dense = dense_params(self.cfg) if self.lr.target_reduction > 0 else 0
        rank_map = rank_map_for(self.mode, self.lr, layers, self.scales, srs, dense)
        self.rank_map = self.engine.from_rank0(rank_map)
        self.switch_step = step + 1
        convert_engine(self.engine, self.cfg, self.rank_map)
        self._trainable = lr_mod.trainable_params(self.engine.view)
        metrics.update(self.switch_metrics())
        self._write_rank_map()
        new = self.make_optimizer(self.engine, self.cfg)
        restore_dense_state(self.engine, new, kept)
        return new, metrics

    def switch_metrics(self) -> dict[str, float]:
        out = {f"rank/{n}": float(r) for n, r in self.rank_map.items()}
        out["lowrank/switch_step"] = float(self.switch_step or 0)
        out["lowrank/switch_frac"] = float((self.switch_step or 0) / self.cfg.train.steps)
        out["lowrank/switch_forced"] = float(self.forced)
        out["params/trainable"] = float(self._trainable)
        return out

    # --- measurement ---
    def _measure(self) -> dict[str, dict[str, float]]:
        """Every signal of every candidate layer (signals.py), on every rank alike (merged
        over pipeline stages); the scales are fixed at the first measurement."""
        model = self.engine.view
        found = lr_mod.candidates(model, self.lr, self.cfg.model.n_layers)
        if not self.probes:
            self.probes = lr_mod.make_probes(lr_mod.shapes(found), self.cfg.train.seed)
        if not self.signals:
            self.signals = self._initial_signals([n for n, _ in found])
        local: dict[str, dict[str, float]] = {}
        for name, module in found:
            w = lr_mod.full_weight(module.weight)
            sr = self.probes[name](w, self.lr.power_iters)
            scale = self.scales.get(name, min(w.shape) / max(sr, 1e-12))
            local[name] = {**self.signals[name].measure(
                w, sr, scale, self.lr.rank_lower_bound, self.lr.round_to, self.lr.energy),
                "out": float(w.shape[0]), "in": float(w.shape[1]), "scale": scale}
        everything = merged(self.engine, local)
        self.shapes = {n: (int(v["out"]), int(v["in"])) for n, v in everything.items()}
        return dict(sorted(everything.items()))

    def _initial_signals(self, names: list[str]) -> dict[str, sig.LayerSignals]:
        """W0 of each local candidate, rebuilt from the seed (so a resumed run has it too)."""
        init = dict(build(self.cfg.model, self.cfg.train.seed, "cpu").named_modules())
        return {n: sig.LayerSignals(init[n].weight) for n in names}

    def _check(self, steps_done: int) -> dict[str, float]:
        """Measure, feed the detector, record the history and queue the per-layer metrics;
        returns the stable ranks."""
        meas = self._measure()
        if not self.scales:
            self.scales = {n: v["scale"] for n, v in meas.items()}
        progress = 100.0 * steps_done / self.cfg.train.steps
        self.detector.observe(progress, {n: sig.level(self.lr.signal, v, self.scales[n])
                                         for n, v in meas.items()})
        for n, v in meas.items():
            rate = self.detector.rate.get(n, float("nan"))
            self.history.setdefault(n, []).append(
                [float(steps_done), v["sr"], v["rank"], v["energy_rank"], v["overlap"], rate])
            self._pending.update({f"sr/{n}": v["sr"], f"lowrank/rank/{n}": v["rank"],
                                  f"lowrank/energy_rank/{n}": v["energy_rank"],
                                  f"lowrank/overlap/{n}": v["overlap"]})
            if rate == rate:
                self._pending[f"lowrank/rate/{n}"] = rate
        self._pending["lowrank/open_layers"] = float(self.detector.n_open())
        return {n: v["sr"] for n, v in meas.items()}

    # --- artifacts ---
    def _write_rank_map(self) -> None:
        if not self.engine.is_main or not self.run_dir:
            return
        path = os.path.join(self.run_dir, "rank_map.json")
        body = {"mode": self.mode, "switch_step": self.switch_step, "forced": self.forced,
                "signal": self.lr.signal, "total_steps": self.cfg.train.steps,
                "layers": {n: {"rank": r, "out": self.shapes[n][0], "in": self.shapes[n][1],
                               "scale": self.scales.get(n)}
                           for n, r in sorted(self.rank_map.items())},
                "signals": self._last_signals(),
                "dense": sorted(set(self.shapes) - set(self.rank_map))}
        with open(path, "w") as f:
            json.dump(body, f, indent=1)
        self.tracker.log_artifact(path, "lowrank")

    def _last_signals(self) -> dict[str, dict[str, float | None]]:
        """Each measured layer's signals at its last check and when it latched (% of
        training; None: open at the switch): the audit trail of the switch."""
        out: dict[str, dict[str, float | None]] = {}
        for n, rows in sorted(self.history.items()):
            last = {k: (v if v == v else None) for k, v in zip(COLUMNS, rows[-1])}  # NaN
            out[n] = {**last, "latched_pct": self.detector.latched.get(n)}
        return out

    def finish(self) -> None:
        """The stable-rank plot (and the rank map again, for runs resumed after the switch)."""
        if not self.engine.is_main or not self.run_dir or not self.history:
            return
        path = os.path.join(self.run_dir, "stable_rank.png")
        plot_stable_ranks({n: [(r[0], r[1]) for r in rows] for n, rows in self.history.items()},
                          self.switch_step, path)
        self.tracker.log_artifact(path, "lowrank")
        if self.mode == "adaptive":
            path = os.path.join(self.run_dir, "signals.png")
            plot_signals(self.history, self.shapes, self.cfg.train.steps, self.switch_step,
                         self.detector, self.lr.signal, path)
            self.tracker.log_artifact(path, "lowrank")
        if self.switch_step is not None:
            self._write_rank_map()

    # --- checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        return {KEY: self._state()}

    def _state(self) -> dict[str, Any]:
        return {"mode": self.mode, "scales": dict(self.scales), "shapes": dict(self.shapes),
                "probes": {n: p.state_dict() for n, p in self.probes.items()},
                "detector": self.detector.state_dict(), "forced": self.forced,
                "signals": {n: s.state_dict() for n, s in self.signals.items()},
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
        self.forced = bool(state.get("forced", False))
        saved = state.get("signals", {})
        if saved:
            self.signals = self._initial_signals(sorted(saved))
            for n, st in saved.items():
                self.signals[n].load_state_dict(st)
        self.history = {k: [list(x) for x in v] for k, v in state["history"].items()}
        self.rank_map = dict(state["rank_map"])
        self.switch_step = state["switch_step"]
        for hook, saved in zip(self._powersgd, state.get("powersgd", [])):
            hook.load_state_dict(saved)


def make_hooks(cfg: RunConfig, engine: Engine, tracker: Any, run_dir: str) -> LoopHooks:
    """The loop hooks for `lowrank.mode`: none (the defaults) when it is off."""
    if cfg.lowrank.mode == "off":
        return LoopHooks()
    return LowRankController(cfg, engine, tracker, run_dir)
