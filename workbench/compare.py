"""How a report tells compared runs apart, and whether their differences are more than noise.

A communication-saving trick that changes val_loss by 0.3% has not been shown to help or hurt
until that is set against the run-to-run noise, and that needs several seeds per configuration.
When the compared runs hold them (`+sweep=lowrank_vs_fullrank
'+sweep.space.train.seed=[1,2,3]' sweep.n_trials=12`, or `--multirun train.seed=1,2,3 ...`),
the report groups runs by configuration and compares each group with the baseline's seed by
seed: runs that share a seed share their initial weights and their batches, so the paired
difference cancels most of the seed-to-seed spread, where comparing two means would not. The
interval is Student's t over the paired differences (95%, two-sided), which assumes they are
roughly normal.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

# Bookkeeping that differs between any two runs without saying how they differ.
NOT_LABELS = ("train.run_dir", "train.init_from", "lowrank.mode", "tracking.", "train.threads")
SEED = "train.seed"

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; past 30 the last one, which
# overstates the interval by at most 4% (t = 1.96 in the limit).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def labels(params: List[Dict[str, str]], tags: List[Dict[str, str]],
           ignore: Sequence[str] = (), unique: bool = True) -> List[str]:
    """Each run's `lowrank.mode` (what the low-rank comparison varies) when that tells the runs
    apart; else the mode with up to three params that differ between the runs (branches of one
    run differ in schedule and length, a layout sweep in its layout) and the step a run started
    from another's checkpoint at; `#N` when even those repeat (unless not `unique`: then equal
    labels are one group). Params in `ignore` never label."""
    modes = [p.get("lowrank.mode", "run") for p in params]
    skip = NOT_LABELS + tuple(ignore)
    varying = sorted((k for k in params[0] if not k.startswith(skip)
                      and len({p.get(k) for p in params}) > 1),
                     key=lambda k: not k.startswith("train.")) \
        if len(set(modes)) < len(modes) else []
    out, seen = [], {}
    for mode, p, t in zip(modes, params, tags):
        parts = [mode] + [f"{_short(k)}={p.get(k)}" for k in varying[:3]]
        if "wb.init_step" in t:
            parts.append(f"from step {t['wb.init_step']}")
        label = " ".join(parts)
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 or not unique else f"{label}#{seen[label]}")
    return out


def _short(key: str) -> str:
    """`train.steps` as `steps`; a group's choice (`layout.name`) as the group (`layout`)."""
    section, _, name = key.rpartition(".")
    return section or name if name == "name" else name


@dataclass(frozen=True)
class Interval:
    """A mean paired difference and its 95% interval over n pairs."""

    mean: float
    low: float
    high: float
    n: int


def paired_interval(diffs: Sequence[float]) -> Optional[Interval]:
    """Student's t interval of the mean of `diffs`; None below 2 pairs (no spread to use)."""
    d = [x for x in diffs if math.isfinite(x)]
    if len(d) < 2:
        return None
    mean = statistics.fmean(d)
    half = T95[min(len(d) - 1, len(T95)) - 1] * statistics.stdev(d) / math.sqrt(len(d))
    return Interval(mean, mean - half, mean + half, len(d))


def verdict(iv: Optional[Interval], below: str, above: str) -> str:
    """`below` / `above` when the whole interval lies there, else within the seed noise."""
    if iv is None:
        return "needs 2 shared seeds"
    if iv.high < 0:
        return below
    if iv.low > 0:
        return above
    return "within seed noise"


def _per_seed(runs: Sequence[Any]) -> Dict[str, Any]:
    return {r.params.get(SEED, ""): r for r in runs}


def seed_rows(runs: Sequence[Any], groups: Sequence[str], base: str) -> List[Dict[str, Any]]:
    """One row per group of runs that differ only in their seed: its seeds, mean and spread of
    the final val_loss, and (for every group but the baseline's) the paired gap in val_loss and
    change in tokens/s against the baseline group, with their intervals and verdicts. Empty when
    no group holds two seeds."""
    members: Dict[str, List[Any]] = {}
    for r, g in zip(runs, groups):
        members.setdefault(g, []).append(r)
    if all(len(_per_seed(m)) < 2 for m in members.values()):
        return []
    ref = _per_seed(members[base])
    rows = []
    for g, rs in members.items():
        mine = _per_seed(rs)
        vals = [r.final("val_loss") for r in rs]
        row: Dict[str, Any] = {
            "group": g, "seeds": " ".join(sorted(mine)), "val_loss_mean": statistics.fmean(vals),
            "val_loss_sd": statistics.stdev(vals) if len(vals) > 1 else math.nan,
            "tokens_per_s_mean": statistics.fmean(r.median("tokens_per_s") for r in rs)}
        if g != base:
            shared = sorted(set(mine) & set(ref))
            gap = paired_interval([mine[s].final("val_loss") - ref[s].final("val_loss")
                                   for s in shared])
            speed = paired_interval([100.0 * (mine[s].median("tokens_per_s")
                                              / ref[s].median("tokens_per_s") - 1)
                                     for s in shared])
            row.update(_interval_cells("val_loss_gap", gap),
                       val_loss_verdict=verdict(gap, "lower val_loss", "higher val_loss"),
                       **_interval_cells("tokens_per_s_change_pct", speed),
                       tokens_per_s_verdict=verdict(speed, "slower", "faster"))
        rows.append(row)
    return rows


def _interval_cells(name: str, iv: Optional[Interval]) -> Dict[str, Any]:
    if iv is None:
        return {name: math.nan, f"{name}_95ci": ""}
    return {name: iv.mean, f"{name}_95ci": f"[{iv.low:.4g}, {iv.high:.4g}]"}


SEED_COLUMNS = ("group", "seeds", "val_loss_mean", "val_loss_sd", "val_loss_gap",
                "val_loss_gap_95ci", "val_loss_verdict", "tokens_per_s_mean",
                "tokens_per_s_change_pct", "tokens_per_s_change_pct_95ci", "tokens_per_s_verdict")
