"""The layers' switch signals, measured on every rank alike and kept between checks: stable-rank
probes, the signals of signals.py, the switch detector they feed, and the history the plots
and the rank map are drawn from. All of it rides in the checkpoint, so a resumed run measures
exactly what the uninterrupted one did.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from workbench.config import RunConfig
from workbench.lowrank import factorize as lr_mod
from workbench.lowrank import signals as sig
from workbench.lowrank.detector import Criterion, SwitchDetector

COLUMNS = ("step", "sr", "rank", "energy_rank", "overlap", "rate")  # a history row


def criterion(cfg: RunConfig) -> Criterion:
    """The detector's thresholds: the config's, with warm-up as a share of training."""
    lr, t = cfg.lowrank, cfg.train
    return Criterion(threshold=lr.threshold, smooth_pct=lr.smooth_pct,
                     window_pct=lr.window_pct, warmup_pct=100.0 * t.warmup_steps / t.steps,
                     straggler_frac=lr.straggler_frac, straggler_relax=lr.straggler_relax)


class Measurements:
    """Per candidate layer: probe, signals, scale at the first measurement, shape, history;
    `gather` merges every rank's (pipeline stages hold different layers), `build_model` gives
    the seeded initial weights W0."""

    def __init__(self, cfg: RunConfig, gather: Callable[[Any], list],
                 build_model: Callable[[], nn.Module]):
        self.cfg, self.lr, self.gather, self.build_model = cfg, cfg.lowrank, gather, build_model
        self.detector = SwitchDetector(criterion(cfg))
        self.scales: dict[str, float] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        self.probes: dict[str, lr_mod.StableRankProbe] = {}
        self.signals: dict[str, sig.LayerSignals] = {}
        self.history: dict[str, list[list[float]]] = {}  # layer -> rows of COLUMNS
        self.pending: dict[str, float] = {}  # metrics of the last check, not yet logged

    def measure(self, model: nn.Module) -> dict[str, dict[str, float]]:
        """Every signal of every candidate layer, on every rank alike; the scales are fixed at
        the first measurement."""
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
        everything: dict[str, Any] = {}
        for d in self.gather(local):
            everything.update(d)
        self.shapes = {n: (int(v["out"]), int(v["in"])) for n, v in everything.items()}
        return dict(sorted(everything.items()))

    def _initial_signals(self, names: list[str]) -> dict[str, sig.LayerSignals]:
        """W0 of each local candidate, rebuilt from the seed (so a resumed run has it too)."""
        init = dict(self.build_model().named_modules())
        return {n: sig.LayerSignals(init[n].weight) for n in names}

    def check(self, model: nn.Module, steps_done: int) -> dict[str, float]:
        """Measure, feed the detector, record the history and queue the per-layer metrics;
        returns the stable ranks."""
        meas = self.measure(model)
        if not self.scales:
            self.scales = {n: v["scale"] for n, v in meas.items()}
        progress = 100.0 * steps_done / self.cfg.train.steps
        self.detector.observe(progress, {n: sig.level(self.lr.signal, v, self.scales[n])
                                         for n, v in meas.items()})
        for n, v in meas.items():
            rate = self.detector.rate.get(n, float("nan"))
            self.history.setdefault(n, []).append(
                [float(steps_done), v["sr"], v["rank"], v["energy_rank"], v["overlap"], rate])
            self.pending.update({f"sr/{n}": v["sr"], f"lowrank/rank/{n}": v["rank"],
                                 f"lowrank/energy_rank/{n}": v["energy_rank"],
                                 f"lowrank/overlap/{n}": v["overlap"]})
            if rate == rate:
                self.pending[f"lowrank/rate/{n}"] = rate
        self.pending["lowrank/open_layers"] = float(self.detector.n_open())
        return {n: v["sr"] for n, v in meas.items()}

    def take_metrics(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out

    def last_signals(self) -> dict[str, dict[str, float | None]]:
        """Each measured layer's signals at its last check and when it latched (% of
        training; None: open at the switch): the audit trail of the switch."""
        out: dict[str, dict[str, float | None]] = {}
        for n, rows in sorted(self.history.items()):
            last = {k: (v if v == v else None) for k, v in zip(COLUMNS, rows[-1])}  # NaN
            out[n] = {**last, "latched_pct": self.detector.latched.get(n)}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scales": dict(self.scales), "shapes": dict(self.shapes),
                "probes": {n: p.state_dict() for n, p in self.probes.items()},
                "detector": self.detector.state_dict(),
                "signals": {n: s.state_dict() for n, s in self.signals.items()},
                "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scales = dict(state["scales"])
        self.shapes = {k: tuple(v) for k, v in state["shapes"].items()}
        self.probes = {}
        for n, p in sorted(state["probes"].items()):
            probe = lr_mod.StableRankProbe(1, 0)
            probe.load_state_dict(p)
            self.probes[n] = probe
        self.detector.load_state_dict(state["detector"])
        saved = state.get("signals", {})
        if saved:
            self.signals = self._initial_signals(sorted(saved))
            for n, st in saved.items():
                self.signals[n].load_state_dict(st)
        self.history = {k: [list(x) for x in v] for k, v in state["history"].items()}
