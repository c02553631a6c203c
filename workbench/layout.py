"""The parallel layout of one run: a frozen value that the planner proposes and the engine applies.

A layout is identified by a short canonical key (used as the MLflow tag and the Optuna trial
attribute), so that runs with the same layout are comparable by a string match. The value sits
below the planner and imports nothing from it: every rank imports this module, and what makes a
layout valid is the planner's (workbench.plan.search.rules.validate_layout, the rules the
ranking uses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Sequence

from workbench.config import LayoutConfig, TrainConfig
from workbench.errors import ConfigError

# The config's spellings of Layout.recompute and Layout.pp_schedule; the planner's columns code
# them by their position here (workbench.plan.cost.columns).
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full", "selective_op")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
_KEY_ORDER = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
_SHORT = {"dp_replicate": "dpr", "dp_shard": "dps", "tp": "tp", "pp": "pp", "cp": "cp"}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1  # sequences per forward on one data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step per data-parallel rank
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    # layers of each global pipeline stage (pp * virtual_stages of them); () = the even split
    stage_layers: tuple[int, ...] = ()

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum

    def stage_split(self, n_layers: int) -> tuple[int, ...]:
        """Layers of every global stage: the list given, or the even split."""
        return self.stage_layers or even_split(n_layers, self.pp * self.virtual_stages)

    def key(self) -> str:
        """A short canonical string; from_key(key()) == self. An uneven split adds
        `sl7-8x14-7` (a run of equal counts as COUNTxTIMES)."""
        return format_key(self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp,
                          self.sequence_parallel, self.micro_batch, self.grad_accum,
                          self.recompute, self.pp_schedule, self.virtual_stages,
                          format_split(self.stage_layers) if self.stage_layers else "")

    @classmethod
    def from_key(cls, key: str) -> Layout:
        values: dict = {}
        for part in key.split("_"):
            if part == "sp":
                values["sequence_parallel"] = True
            elif part.startswith("rc-"):
                values["recompute"] = part[3:].replace("-", "_")
            elif re.fullmatch(r"sl\d+(x\d+)?(-\d+(x\d+)?)*", part):
                values["stage_layers"] = parse_split(part[2:])
            elif m := re.fullmatch(r"(gpipe|1f1b|interleaved-1f1b)-v(\d+)", part):
                values["pp_schedule"] = m.group(1).replace("-", "_")
                values["virtual_stages"] = int(m.group(2))
            elif m := re.fullmatch(r"(dpr|dps|tp|pp|cp|mb|ga)(\d+)", part):
                name = {v: k for k, v in _SHORT.items()} | {"mb": "micro_batch",
                                                           "ga": "grad_accum"}
                values[name[m.group(1)]] = int(m.group(2))
            else:
                raise ConfigError("layout key", key, f"cannot parse part {part!r}")
        return cls(**values)

    def as_params(self) -> dict:
        """Flat dict for tracking params."""
        return {f"layout.{f.name}": getattr(self, f.name) if f.name != "stage_layers"
                else format_split(self.stage_layers) for f in fields(self)}


def degrees_key(dpr: int, dps: int, tp: int, pp: int, cp: int) -> str:
    """The degrees that open every layout key (a planner row without a whole grad_accum is
    keyed by these and its micro-batch alone)."""
    return f"dpr{dpr}_dps{dps}_tp{tp}_pp{pp}_cp{cp}"


def format_key(dpr: int, dps: int, tp: int, pp: int, cp: int, sp: bool, mb: int, ga: int,
               recompute: str, schedule: str, virtual_stages: int, split: str) -> str:
    """Layout.key() from its values (`split`: format_split of the stage list, '' for the even
    split), so that a ranking of 400,000 layouts is keyed without building one Layout each."""
    key = degrees_key(dpr, dps, tp, pp, cp) + ("_sp" if sp else "")
    key += f"_mb{mb}_ga{ga}_rc-{recompute.replace('_', '-')}"  # "_" separates the parts
    if pp > 1:
        key += f"_{schedule.replace('_', '-')}-v{virtual_stages}"
    return key + (f"_sl{split}" if split else "")


def auto_micro_batch(global_batch: int, dp: int, pp: int = 1) -> int:
    """`train.micro_batch=0`: as many sequences per forward as the global batch allows without
    accumulation, so every data-parallel layout runs on the defaults. A pipeline needs at least
    pp micro-batches in flight (1F1B and interleaved reject fewer, and fewer leave GPipe mostly
    bubble), so there the micro-batch is the largest that leaves a multiple of pp of them."""
    per_rank = max(1, global_batch // max(1, dp))
    if pp <= 1:
        return per_rank
    fits = [m for m in range(per_rank, 0, -1) if per_rank % m == 0 and per_rank // m >= pp]
    whole = [m for m in fits if (per_rank // m) % pp == 0]
    return (whole or fits or [1])[0]


def resolve(cfg: LayoutConfig, train: TrainConfig, world_size: int) -> Layout:
    """Turn the asked-for degrees (with at most one -1 = "the rest") into a concrete Layout."""
    degrees = {n: getattr(cfg, n) for n in _KEY_ORDER}
    fill = [n for n, d in degrees.items() if d == -1]
    for n, d in degrees.items():
        if d == 0 or d < -1:
            raise ConfigError(f"layout.{n}", d, "must be a positive degree or -1 (the rest)")
    if len(fill) > 1:
        raise ConfigError(f"layout.{fill[1]}", -1, f"only one degree may be -1; {fill[0]} is")
    fixed = 1
    for d in degrees.values():
        if d != -1:
            fixed *= d
    if fill:
        if world_size % fixed:
            raise ConfigError(f"layout.{fill[0]}", -1,
                              f"world size {world_size} is not divisible by the other degrees' "
                              f"product {fixed}")
        degrees[fill[0]] = world_size // fixed
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    micro = train.micro_batch or auto_micro_batch(train.global_batch, dp, degrees["pp"])
    per_step = dp * micro
    if train.global_batch % per_step:
        if not train.micro_batch:
            raise ConfigError("train.global_batch", train.global_batch,
                              f"must be a multiple of dp ({dp}) (the data-parallel degree)")
        raise ConfigError("train.global_batch", train.global_batch,
                          f"must be a multiple of dp ({dp}) x train.micro_batch "
                          f"({train.micro_batch}) = {per_step}")
    return Layout(**degrees, sequence_parallel=cfg.sequence_parallel,
                  micro_batch=micro, grad_accum=train.global_batch // per_step,
                  recompute=cfg.recompute, pp_schedule=cfg.pp_schedule,
                  virtual_stages=cfg.virtual_stages, stage_layers=_stage_layers(cfg))


def _stage_layers(cfg: LayoutConfig) -> tuple[int, ...]:
    """layout.stage_layers as a tuple of ints (a list of whole numbers in the config)."""
    layers = list(cfg.stage_layers or ())
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in layers):
        raise ConfigError("layout.stage_layers", layers,
                          "must be a list of layer counts, one per global pipeline stage")
    return tuple(layers)


def even_split(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """The even split (n_stages must divide n_layers; a rule says so before anything runs)."""
    return (n_layers // n_stages,) * n_stages


def format_split(layers: Sequence[int]) -> str:
    """`7-8x14-7`: a run of equal counts as COUNTxTIMES (the key form; parse_split inverts)."""
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j < len(layers) and layers[j] == layers[i]:
            j += 1
        parts.append(str(layers[i]) if j - i == 1 else f"{layers[i]}x{j - i}")
        i = j
    return "-".join(parts)


def parse_split(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split("-"):
        count, _, times = part.partition("x")
        out += [int(count)] * (int(times) if times else 1)
    return tuple(out)
