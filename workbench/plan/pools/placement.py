"""Where a pipeline's stages sit on a mixed cluster's pools: the typed value and its text.

A stage's data-parallel replicas (each dp_shard x cp x tp GPUs of one pool) may sit on more than
one pool: `h100+a100:16` is one stage of 16 layers whose replicas are shared evenly between the
two pools, `h100*1+a100*3:16` puts one replica on h100 and three on a100 (the counts sum to
dp_replicate), in replica order. A mixed stage steps at its slowest replica's pace and its
gradient all-reduce crosses the pools' link (workbench.plan.pools.pipeline). Stages read in
pipeline order, separated by `|`; a group's layer counts are written as layout keys write them
(`a100:8x2` is two stages of 8 layers), and a group without counts is one stage whose layers
come from elsewhere (layout.stage_layers, or the even split).

The search fills the pools of an ordered selection replica by replica (`fill`), so a stage that
straddles two pools is a mixed stage; `Members` holds placements as the arrays the stage
matrices are built from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from workbench.errors import ConfigError
from workbench.layout import format_split, parse_split


@dataclass(frozen=True)
class StagePlace:
    """One pipeline stage: (pool, replicas) in replica order, and its layers (None: not given)."""

    members: tuple[tuple[str, int], ...]
    layers: int | None = None

    @property
    def replicas(self) -> int:
        return sum(n for _, n in self.members)

    @property
    def mixed(self) -> bool:
        return len(self.members) > 1


@dataclass(frozen=True)
class Placement:
    """Every stage of one pipeline over pools, in pipeline order."""

    stages: tuple[StagePlace, ...]

    def text(self) -> str:
        """`h100:18 | h100*1+a100*3:8-6`: consecutive stages on the same replicas grouped."""
        out: list[str] = []
        i = 0
        while i < len(self.stages):
            j = i
            while j < len(self.stages) and self.stages[j].members == self.stages[i].members:
                j += 1
            layers = [s.layers for s in self.stages[i:j]]
            who = format_members(self.stages[i].members)
            if any(n is None for n in layers):
                out += [who] * (j - i)
            else:
                out.append(f"{who}:{format_split([int(n) for n in layers if n is not None])}")
            i = j
        return " | ".join(out)

    @property
    def layers(self) -> tuple[int, ...] | None:
        given = [s.layers for s in self.stages]
        return None if any(n is None for n in given) else tuple(int(n) for n in given if n)

    def with_layers(self, layers: Sequence[int]) -> Placement:
        return Placement(tuple(StagePlace(s.members, int(n))
                               for s, n in zip(self.stages, layers)))

    def pools(self) -> tuple[str, ...]:
        """The pools it uses, in pipeline order, each once."""
        return tuple(dict.fromkeys(p for s in self.stages for p, _ in s.members))

    def replicas_on(self, pool: str) -> int:
        return sum(n for s in self.stages for p, n in s.members if p == pool)


def format_members(members: Sequence[tuple[str, int]]) -> str:
    """`h100`, `h100+a100` (replicas shared evenly) or `h100*1+a100*3`."""
    if len({n for _, n in members}) == 1:
        return "+".join(p for p, _ in members)
    return "+".join(f"{p}*{n}" for p, n in members)


def parse_placement(text: str, pools: Sequence[str], replicas: int,
                    key: str = "--stages") -> Placement:
    """The Placement `text` writes for a layout of `replicas` data-parallel replicas per stage
    over `pools` (their names); ConfigError naming `key` and what is valid otherwise."""
    example = f"e.g. {pools[0]}:16 | {'+'.join(pools[:2])}:16" if pools else ""

    def bad(why: str) -> ConfigError:
        return ConfigError(key, text, f"{why} ({example}; pools: {', '.join(pools)})")

    stages: list[StagePlace] = []
    groups = [g.strip() for g in text.split("|")]
    counted = {":" in g for g in groups}
    if not text.strip() or len(counted) > 1:
        raise bad("stages as POOL[+POOL...][:LAYERS] separated by '|', every one with its "
                  "layer counts or none")
    for g in groups:
        who, _, split = g.partition(":")
        members = _members(who, pools, replicas, bad)
        if not split:
            stages.append(StagePlace(members))
            continue
        try:
            layers = parse_split(split.replace(" ", ""))
        except ValueError:
            raise bad(f"{split!r}: layer counts as 8, 8-6 or 8x2") from None
        stages += [StagePlace(members, n) for n in layers]
    return Placement(tuple(stages))


def _members(text: str, pools: Sequence[str], replicas: int,
             bad: Callable[[str], ConfigError]) -> tuple[tuple[str, int], ...]:
    """`h100`, `h100+a100` or `h100*1+a100*3` with the stage's replicas given out."""
    parts = [p.strip().partition("*") for p in text.split("+")]
    names = [p[0].strip() for p in parts]
    unknown = [n for n in names if n not in pools]
    if unknown or len(set(names)) < len(names):
        raise bad(f"{unknown[0]!r} is no pool" if unknown else
                  f"{text.strip()!r} names a pool twice")
    given = [p[2].strip() for p in parts]
    if all(not g for g in given):
        if replicas % len(names):
            raise bad(f"{replicas} replicas do not share evenly over {len(names)} pools: give "
                      f"counts, e.g. {names[0]}*1+{names[1]}*{replicas - 1}")
        return tuple((n, replicas // len(names)) for n in names)
    if not all(g.isdigit() and int(g) > 0 for g in given) or \
            sum(int(g) for g in given) != replicas:
        raise bad(f"{text.strip()!r}: replica counts (POOL*N, every pool) summing to "
                  f"dp_replicate={replicas}")
    return tuple((n, int(g)) for n, g in zip(names, given))


def fill(slots: Sequence[tuple[int, int]], replicas: int) -> list[tuple[tuple[int, int], ...]]:
    """Stages of `replicas` replicas each over pools in order, given (pool, replica slots) of
    each: the pools filled replica by replica, so a stage that straddles two pools is mixed.
    The slots must add up to a whole number of stages."""
    out: list[tuple[tuple[int, int], ...]] = []
    stage: list[tuple[int, int]] = []
    room = replicas
    for pool, free in slots:
        while free:
            take = min(free, room)
            stage.append((pool, take))
            free, room = free - take, room - take
            if not room:
                out.append(tuple(stage))
                stage, room = [], replicas
    return out


@dataclass(frozen=True)
class Members:
    """N placements as (N, S, K) arrays, K the most pools one stage spans: replicas lo..hi-1 of
    stage s sit on pool[i, s, k] (-1: no member; stages past a layout's last have none)."""

    pool: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def of(cls, stages: Sequence[Sequence[Sequence[tuple[int, int]]]]) -> Members:
        """From N placements, each a list of stages, each a list of (pool index, replicas)."""
        n = len(stages)
        s = max(len(x) for x in stages)
        k = max(len(m) for x in stages for m in x)
        at: list[tuple[int, int, int]] = []
        rows: list[tuple[int, int, int]] = []  # (pool, lo, hi), filled at once below
        for i, x in enumerate(stages):
            for j, members in enumerate(x):
                start = 0
                for m, (p, count) in enumerate(members):
                    at.append((i, j, m))
                    rows.append((p, start, start + count))
                    start += count
        pool = np.full((n, s, k), -1, dtype=np.int64)
        lo, hi = np.zeros((n, s, k)), np.zeros((n, s, k))
        where, vals = tuple(np.array(at).T), np.array(rows).T
        pool[where], lo[where], hi[where] = vals
        return cls(pool, lo, hi)

    @classmethod
    def single(cls, pool_idx: np.ndarray) -> Members:
        """One pool a stage ((N, S) pool indices, -1 past the last stage)."""
        on = (pool_idx >= 0)[..., None].astype(float)
        return cls(np.asarray(pool_idx)[..., None], 0 * on, on)
