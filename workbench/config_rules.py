"""The rules of a run config that a type cannot express: ranges, cross-field divisibility,
finite and int64-representable numbers. Each failure is a ConfigError naming the first bad key,
which the command line reports as one line with exit status 2.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import List

from workbench.config import (
    CHOICES,
    ClusterConfig,
    DataConfig,
    LowRankConfig,
    RunConfig,
    TrainConfig,
)
from workbench.errors import ConfigError


def _positive(cfg: RunConfig, keys: List[str]) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value > 0:
            raise ConfigError(key, value, "must be > 0")


def _representable(cfg: RunConfig) -> None:
    """Every number of every section is one torch and numpy take: an integer within int64, a
    float finite. Past that (1e20 layers, a NaN learning rate, an infinite norm epsilon) a run
    would hang building the model, overflow in a C call or train to a NaN loss."""
    for section in fields(cfg):
        sub = getattr(cfg, section.name)
        for f in fields(sub) if is_dataclass(sub) else ():
            value, key = getattr(sub, f.name), f"{section.name}.{f.name}"
            if isinstance(value, int) and not -2**63 <= value < 2**63:
                raise ConfigError(key, value, "must be an integer in [-2**63, 2**63)")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(key, value, "must be a finite number")


def _validate_train(t: TrainConfig) -> None:
    """The optimizer's and loop's numbers, each naming its key and range when out of it."""
    rules = [("seed", 0 <= t.seed < 2**63, "must be an integer in [0, 2**63)"),
             ("micro_batch", t.micro_batch >= 0,
              "must be >= 0 (0 = as large as the global batch allows per dp rank)"),
             ("warmup_steps", t.warmup_steps >= 0, "must be >= 0"),
             ("decay_steps", t.decay_steps == 0 or (
                 t.lr_schedule == "wsd" and t.decay_steps <= t.steps - t.warmup_steps),
              "0 (20% of the steps), or with train.lr_schedule=wsd in [1, train.steps - "
              f"train.warmup_steps = {t.steps - t.warmup_steps}]"),
             ("min_lr_ratio", 0.0 <= t.min_lr_ratio <= 1.0, "must be in [0, 1]"),
             ("beta1", 0.0 <= t.beta1 < 1.0, "must be in [0, 1) (AdamW)"),
             ("beta2", 0.0 <= t.beta2 < 1.0, "must be in [0, 1) (AdamW)"),
             ("weight_decay", t.weight_decay >= 0, "must be >= 0"),
             ("grad_clip", t.grad_clip >= 0, "must be >= 0 (0 disables clipping)"),
             ("keep_every", t.keep_every >= 0,
              "must be >= 0 (checkpoints at its multiples are kept; 0: none)"),
             ("threads", 0 <= t.threads < 2**31, "must be in [0, 2**31) (0 = torch default)")]
    for key, ok, valid in rules:
        if not ok:
            raise ConfigError(f"train.{key}", getattr(t, key), valid)


def _validate_mixture(d: DataConfig) -> None:
    """Weights name sources and sum to a positive number (a mixture must draw something)."""
    for key in ("weights", "target"):
        weights = getattr(d, key)
        for name, w in weights.items():
            if name not in d.sources:
                raise ConfigError(f"data.{key}.{name}", w,
                                  f"names no source; sources: {', '.join(d.sources) or 'none'}")
            if not w >= 0 or w == float("inf"):
                raise ConfigError(f"data.{key}.{name}", w, "must be a finite number >= 0")
        if weights and not sum(weights.values()) > 0:
            raise ConfigError(f"data.{key}", dict(weights), "must sum to a positive number")
    for name, path in d.sources.items():
        if not path:
            raise ConfigError(f"data.sources.{name}", path,
                              "a folder made by python -m workbench.data.prepare or stdlib:PART")


def _validate_lowrank(lr: LowRankConfig) -> None:
    """The switch criterion's numbers: each names its key and range when out of it."""
    rules = [("check_every", lr.check_every > 0, "must be > 0 (steps between checks)"),
             ("threshold", lr.threshold > 0, "must be > 0 (% of full rank per 1% of training)"),
             ("smooth_pct", lr.smooth_pct > 0, "must be > 0 (% of training)"),
             ("window_pct", 0 <= lr.window_pct <= 100, "must be in [0, 100] (% of training)"),
             ("straggler_frac", 0 <= lr.straggler_frac < 1, "must be in [0, 1)"),
             ("straggler_relax", lr.straggler_relax >= 1, "must be >= 1"),
             ("energy", 0 < lr.energy <= 1, "must be in (0, 1]"),
             ("target_reduction", 0 <= lr.target_reduction < 1,
              "must be in [0, 1) (share of full rank's bytes per step saved; 0: off)"),
             ("min_switch_frac", 0 <= lr.min_switch_frac <= 1, "must be in [0, 1]"),
             ("max_switch_frac", lr.min_switch_frac <= lr.max_switch_frac <= 1,
              f"must be in [lowrank.min_switch_frac={lr.min_switch_frac}, 1]")]
    for key, ok, valid in rules:
        if not ok:
            raise ConfigError(f"lowrank.{key}", getattr(lr, key), valid)


def _validate_profile(cluster: ClusterConfig) -> None:
    """A measured cluster file is used only where it is valid: measured on this cluster's kind
    of device and with the torch that will run (a kernel library's update moves every curve),
    with tables whose columns line up and times that are positive."""
    prof = cluster.profile
    if prof is None:
        return
    key = "cluster.profile"
    meta = prof.measured
    if meta.device_type != cluster.device:
        raise ConfigError(f"{key}.measured.device_type", meta.device_type,
                          f"measured on {meta.device_type} but cluster.device={cluster.device}; "
                          "profile this cluster again (python -m workbench.profile)")
    installed = installed_torch()
    if installed and meta.torch != installed:
        raise ConfigError(f"{key}.measured.torch", meta.torch,
                          f"measured with torch {meta.torch}, this environment has torch "
                          f"{installed}; profile again (python -m workbench.profile)")
    if not prof.compute:
        raise ConfigError(f"{key}.compute", [], "a profile needs at least one compute level")
    tables = [(f"{key}.compute[{i}].{name}[{j}]", t, cols)
              for i, level in enumerate(prof.compute)
              for name, cols in (("gemm", _GEMM_COLS), ("blocks", _BLOCK_COLS))
              for j, t in enumerate(getattr(level, name))]
    tables += [(f"{key}.compute[{i}].elementwise", level.elementwise, ("bytes", "s"))
               for i, level in enumerate(prof.compute)]
    tables += [(f"{key}.comms[{i}]", c, ("bytes", "s")) for i, c in enumerate(prof.comms)]
    tables += [(f"{key}.probes[{i}]", p, _PROBE_COLS + (("busy",) if p.busy else ())
               + (("ref_s",) if p.ref_s else ()) + (("opt_s",) if p.opt_s else ()))
               for i, p in enumerate(prof.probes)]
    for where, table, cols in tables:
        lengths = {len(getattr(table, c)) for c in cols}
        if where.startswith(f"{key}.probes"):
            lengths.add(len(table.kind))
        if len(lengths) != 1 or not lengths.pop():
            raise ConfigError(where, "", f"columns {', '.join(cols)} must be non-empty lists "
                              "of one length")
        for c in cols:
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                       for v in getattr(table, c)):
                raise ConfigError(f"{where}.{c}", getattr(table, c),
                                  "must be finite numbers >= 0")
    for i, c in enumerate(prof.comms):
        if c.kind not in COMM_KINDS or c.span not in ("intra", "inter") or c.group < 2:
            raise ConfigError(f"{key}.comms[{i}]", f"{c.kind} x{c.group} {c.span}",
                              f"kind in {', '.join(COMM_KINDS)}, span intra|inter, group >= 2")


_GEMM_COLS = ("k", "n", "tokens", "fwd_s", "bwd_s")
_BLOCK_COLS = ("tp", "tokens", "fwd_s", "bwd_s", "loss_fwd_s", "loss_bwd_s")
_PROBE_COLS = ("degree", "layers", "micro_batch", "tokens", "step_s")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def installed_torch() -> str:
    """torch's version as installed, read without importing it (the driver never loads torch)."""
    from workbench.track.manifest import versions

    return str(versions()["torch"] or "")


def validate(cfg: RunConfig) -> None:
    """Cross-field rules of a run config; raises ConfigError naming the first bad key."""
    for key, valid in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in valid:
            raise ConfigError(key, value, f"must be one of {', '.join(valid)}")
    m = cfg.model
    _representable(cfg)
    _positive(cfg, ["model.n_layers", "model.hidden", "model.n_heads", "model.n_kv_heads",
                    "model.ffn_hidden", "model.vocab", "model.seq_len", "model.norm_eps",
                    "model.rope_theta", "train.steps", "train.global_batch", "train.lr",
                    "train.eval_every", "train.eval_batches", "train.ckpt_every",
                    "train.keep_ckpts", "train.log_every", "data.max_bytes", "cluster.nodes",
                    "cluster.gpus_per_node", "cluster.peak_bf16_flops", "cluster.peak_fp32_flops",
                    "cluster.hbm_bytes", "cluster.hbm_bw_bytes_per_s", "cluster.intra_node_gbps",
                    "cluster.inter_node_gbps"])
    if m.hidden % m.n_heads:
        raise ConfigError("model.n_heads", m.n_heads,
                          f"must divide model.hidden={m.hidden}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", m.n_kv_heads,
                          f"must divide model.n_heads={m.n_heads}")
    if m.family == "llama" and (m.hidden // m.n_heads) % 2:
        raise ConfigError("model.hidden", m.hidden,
                          "hidden / n_heads must be even for rotary embeddings")
    _validate_train(cfg.train)
    if cfg.layout.mem_margin_gib < 0:
        raise ConfigError("layout.mem_margin_gib", cfg.layout.mem_margin_gib,
                          "must be >= 0 (GiB a layout must leave free beyond its predicted peak)")
    if not 0.0 < cfg.data.val_frac < 0.5:
        raise ConfigError("data.val_frac", cfg.data.val_frac, "must be in (0, 0.5)")
    _validate_mixture(cfg.data)
    _validate_lowrank(cfg.lowrank)
    _validate_profile(cfg.cluster)
    if cfg.data.name == "tokens" and not cfg.data.path and not cfg.data.sources:
        raise ConfigError("data.path", cfg.data.path,
                          "data=tokens needs a folder made by python -m workbench.data.prepare")
    if cfg.launcher.nproc_per_node <= 0 or cfg.launcher.nodes <= 0:
        raise ConfigError("launcher.nproc_per_node", cfg.launcher.nproc_per_node, "must be > 0")
