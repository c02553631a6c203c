"""Cuttlefish (Wang et al. 2023) as loop hooks: train dense, switch once to low rank.

Before the switch the hooks measure the layers' stable ranks (measure.py); when the switch
policy says so (at a fixed share of training, or once the detector sees every layer settle),
rank 0 picks the rank map, every rank factorizes the same layers, the engine is rebuilt around
the factorized model (the same layout, parallelism applied anew) and a new optimizer takes over.
After it, Frobenius decay regularizes each factorized layer's product. The hooks' state rides in
every checkpoint, so a resume before or after the switch is exact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
from torch import nn

from workbench.config import RunConfig
from workbench.lowrank import factorize as lr_mod
from workbench.lowrank.detector import forced, should_switch
from workbench.lowrank.measure import Measurements
from workbench.lowrank.plots import plot_signals, plot_stable_ranks
from workbench.lowrank.ranks import LayerShape, rank_map_for
from workbench.lowrank.saved import KEY, saved_state
from workbench.train.hooks import HookContext, LoopHooks


class FixedSwitch:
    """Switch after `lowrank.switch_frac` of training, at the ranks the scales give."""

    mode = "fixed"

    def __init__(self, cfg: RunConfig):
        self.at_step = max(1, round(cfg.lowrank.switch_frac * cfg.train.steps))

    def due(self, step: int, meas: Measurements, model: nn.Module
            ) -> tuple[bool, dict[str, float]]:
        """Whether rank 0 would switch after `step`, and the stable ranks measured for it."""
        return step + 1 >= self.at_step, {}

    def at_switch(self, meas: Measurements, model: nn.Module, srs: dict[str, float]
                  ) -> tuple[dict[str, float], bool]:
        """The stable ranks the rank map is computed from, and whether the cap forced it."""
        return srs, False

    def plots(self, meas: Measurements, run_dir: str, switch_step: int | None) -> list[str]:
        return []


class AdaptiveSwitch:
    """Switch once every layer's signal has settled (detector.py), checked every
    `lowrank.check_every` steps; never before warm-up or `min_switch_frac`, and at the latest
    at `max_switch_frac`."""

    mode = "adaptive"

    def __init__(self, cfg: RunConfig):
        self.cfg, self.lr = cfg, cfg.lowrank

    def due(self, step: int, meas: Measurements, model: nn.Module
            ) -> tuple[bool, dict[str, float]]:
        total, lr = self.cfg.train.steps, self.lr
        at_check = (step + 1) % lr.check_every == 0
        srs = meas.check(model, step + 1) if at_check else {}
        go = (at_check or forced(step, total, lr.max_switch_frac)) and should_switch(
            meas.detector, step, total, self.cfg.train.warmup_steps, lr.min_switch_frac,
            lr.max_switch_frac)
        return go, srs

    def at_switch(self, meas: Measurements, model: nn.Module, srs: dict[str, float]
                  ) -> tuple[dict[str, float], bool]:
        if not srs:  # forced by max_switch_frac between checks
            srs = {n: v["sr"] for n, v in meas.measure(model).items()}
        return srs, not meas.detector.settled()

    def plots(self, meas: Measurements, run_dir: str, switch_step: int | None) -> list[str]:
        path = os.path.join(run_dir, "signals.png")
        plot_signals(meas.history, meas.shapes, self.cfg.train.steps, switch_step,
                     meas.detector, self.lr.signal, path)
        return [path]


def dense_params(build_model: Callable[[], nn.Module]) -> int:
    """Trainable parameters of the whole dense model (every pipeline stage's, tied weights
    once): the base of lowrank.target_reduction. Built on the CPU: on the meta device the
    tied head and embedding come apart and would count twice."""
    return sum(p.numel() for p in build_model().parameters() if p.requires_grad)


def dense_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state of every parameter, by name and with its shape, taken before
    the switch rebuilds the model (the parameter objects do not survive the rebuild)."""
    return {n: (tuple(p.shape), optimizer.state[p]) for n, p in model.named_parameters()
            if p in optimizer.state}


def restore_dense_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                        kept: dict[str, Any]) -> None:
    """Give the parameters that stayed dense (same name and shape) their AdamW moments and
    step count back; only the new factors start from zero.

    Why: a fresh AdamW takes sign-like first steps of the full LR size on every parameter
    (m / sqrt(v) ~ 1 when both hold one gradient), which is what forced the re-warm after the
    switch; the embeddings, norms and the dense first and last blocks lose nothing at the
    switch, so their moments still describe their gradients."""
    for n, p in model.named_parameters():
        shape_state = kept.get(n)
        if shape_state is not None and shape_state[0] == tuple(p.shape):
            optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in shape_state[1].items()}


class Cuttlefish(LoopHooks):
    """The loop's low-rank hooks; `when` (FixedSwitch or AdaptiveSwitch) decides the switch."""

    def __init__(self, ctx: HookContext, when: FixedSwitch | AdaptiveSwitch):
        self.ctx, self.cfg, self.lr, self.engine = ctx, ctx.cfg, ctx.cfg.lowrank, ctx.engine
        self.when = when
        self.meas = Measurements(ctx.cfg, ctx.engine.bookkeeping.gather, ctx.build_model)
        self.rank_map: dict[str, int] = {}
        self.switch_step: int | None = None  # first step trained at low rank
        self.forced = False  # the switch came from max_switch_frac, not the detector

    # --- set-up ---
    def prepare(self, ckpt: Any) -> None:
        """Restore the state (and the factorized shapes) of the checkpoint being resumed, or
        measure the layers at initialization."""
        state = saved_state(ckpt, self.when.mode)
        if state is None:
            self.meas.check(self.engine.view, 0)
            return
        self.load_state_dict(state)
        if self.switch_step is not None:
            self._factorize()

    def no_decay(self) -> set[int]:
        """The factors get Frobenius decay on their product instead of weight decay."""
        return {id(p) for p in lr_mod.factor_params(self.engine.view)}

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
        metrics = self.meas.take_metrics()
        if self.switch_step is not None:
            lr_mod.frobenius_decay(self.engine.view, lr * self.lr.frobenius_decay)
            return optimizer, metrics
        go, srs = self.when.due(step, self.meas, self.engine.view)
        metrics.update(self.meas.take_metrics())
        if not self.engine.bookkeeping.from_rank0(bool(go)):
            return optimizer, metrics
        new = self._switch(step, optimizer, srs)
        return new, {**metrics, **self.switch_metrics()}

    def _switch(self, step: int, optimizer: torch.optim.Optimizer,
                srs: dict[str, float]) -> torch.optim.Optimizer:
        """Pick the rank map (rank 0's, for every rank), factorize, and return the optimizer
        of the factorized model (the dense layers' AdamW state carried over)."""
        view = self.engine.view
        srs, self.forced = self.when.at_switch(self.meas, view, srs)
        kept = dense_state(view, optimizer) if self.lr.keep_dense_state else {}
        layers = [LayerShape(n, *self.meas.shapes[n]) for n in sorted(self.meas.shapes)]
        dense = dense_params(self.ctx.build_model) if self.lr.target_reduction > 0 else 0
        rank_map = rank_map_for(self.when.mode, self.lr, layers, self.meas.scales, srs, dense)
        self.rank_map = self.engine.bookkeeping.from_rank0(rank_map)
        self.switch_step = step + 1
        self._factorize()
        self._write_rank_map()
        new = self.ctx.make_optimizer(self.no_decay())
        restore_dense_state(self.engine.view, new, kept)
        return new

    def _factorize(self) -> None:
        """Gather the full state, build a fresh model, factorize it, and rebuild the engine
        around it (FSDP2 and replication cannot change their parameters under them)."""
        with self.engine.bookkeeping.uncounted():
            full = self.engine.full_state_dict()
            model = self.ctx.build_model()
            model.load_state_dict(full, strict=False)  # a pipeline stage holds some layers
            lr_mod.convert(model, self.rank_map)
            self.engine.rebuild(model)

    def switch_metrics(self) -> dict[str, float]:
        out = {f"rank/{n}": float(r) for n, r in self.rank_map.items()}
        out["lowrank/switch_step"] = float(self.switch_step or 0)
        out["lowrank/switch_frac"] = float((self.switch_step or 0) / self.cfg.train.steps)
        out["lowrank/switch_forced"] = float(self.forced)
        return out

    # --- artifacts ---
    def _write_rank_map(self) -> None:
        if not self.engine.is_main or not self.ctx.run_dir:
            return
        path = os.path.join(self.ctx.run_dir, "rank_map.json")
        shapes, scales = self.meas.shapes, self.meas.scales
        body = {"mode": self.when.mode, "switch_step": self.switch_step, "forced": self.forced,
                "signal": self.lr.signal, "total_steps": self.cfg.train.steps,
                "layers": {n: {"rank": r, "out": shapes[n][0], "in": shapes[n][1],
                               "scale": scales.get(n)}
                           for n, r in sorted(self.rank_map.items())},
                "signals": self.meas.last_signals(),
                "dense": sorted(set(shapes) - set(self.rank_map))}
        with open(path, "w") as f:
            json.dump(body, f, indent=1)
        self.ctx.tracker.log_artifact(path, "lowrank")

    def finish(self) -> None:
        """The plots (and the rank map again, for runs resumed after the switch)."""
        run_dir, history = self.ctx.run_dir, self.meas.history
        if not self.engine.is_main or not run_dir or not history:
            return
        path = os.path.join(run_dir, "stable_rank.png")
        plot_stable_ranks({n: [(r[0], r[1]) for r in rows] for n, rows in history.items()},
                          self.switch_step, path)
        for p in [path, *self.when.plots(self.meas, run_dir, self.switch_step)]:
            self.ctx.tracker.log_artifact(p, "lowrank")
        if self.switch_step is not None:
            self._write_rank_map()

    # --- checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        return {KEY: {"mode": self.when.mode, **self.meas.state_dict(), "forced": self.forced,
                      "rank_map": dict(self.rank_map), "switch_step": self.switch_step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.meas.load_state_dict(state)
        self.forced = bool(state.get("forced", False))
        self.rank_map = dict(state["rank_map"])
        self.switch_step = state["switch_step"]
