"""`python -m workbench.plan model=... cluster=... cluster.nodes=... train.global_batch=...`

Ranks every layout of the model on the cluster's GPUs with the cost model, prints the top 10
and why the others were rejected, and writes the full ranking to a CSV. Hydra overrides pick the
inputs; `--out PATH`, `--top N`, `--world-size N`, `--optuna N` (also run an N-trial Optuna
search and report it), `--margin-gib G` (a layout fits when its predicted peak plus G GiB stays
within HBM), `--tokens T` (each layout's days and GPU-hours for a budget of T tokens) and
`--explain LAYOUT` (itemize one layout's peak memory and step time instead of ranking),
`--stack NAME` (plan for this engine, Megatron-Core, torchtitan, ...: the stacks the published
rows are scored with, workbench.plan.cost.stacks), `--stack-fact KEY=VALUE` (where your run
differs from that stack's defaults, as a row's fact column says it) and `--fp8` (FP8 linears on
the stacks that have them) are the command's own options.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from workbench.cli import ArgParser, guarded
from workbench.compose import compose
from workbench.config import RunConfig
from workbench.errors import ConfigError, InputError
from workbench.layout import degrees_key
from workbench.plan.cost.columns import row_keys
from workbench.plan.cost.explain import explain, render
from workbench.plan.cost.hardware import GIB
from workbench.plan.cost.software import Software
from workbench.plan.cost.stack_facts import plan_facts
from workbench.plan.cost.stacks import STACKS, stack_software
from workbench.plan.pools.cluster import check_fp8, pools_of
from workbench.plan.pools.explain import explain_pools, render_pools
from workbench.plan.pools.report import pool_main
from workbench.plan.search.exhaustive import REASONS, Ranking, rank_layouts
from workbench.plan.search.optuna_search import optuna_search


def budget(tokens: float, tokens_per_s: float, gpus: int) -> tuple[float, float]:
    """Days and GPU-hours to train `tokens` at a predicted rate: a long run's layout is chosen by
    its wall-clock and its bill, which a tokens/s figure leaves to mental arithmetic."""
    seconds = tokens / tokens_per_s
    return seconds / 86400.0, seconds * gpus / 3600.0


def write_ranking(path: Path, r: Ranking, tokens: float = 0.0) -> None:
    """Feasible layouts best first, then the rejected ones with their reason (via a temp file);
    with a token budget, each feasible layout's days and GPU-hours for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    a, order = r.arrays, [int(i) for i in r.order]
    keys = row_keys(a, order)
    world = (a["dpr"] * a["dps"] * a["tp"] * a["pp"] * a["cp"]).astype(np.int64)
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        extra = ["days_for_tokens", "gpu_hours_for_tokens"] if tokens else []
        w.writerow(["rank", "layout", "tokens_per_s", "mfu", "step_time_s", "peak_mem_gib",
                    "fits", "rejected_because", *extra])
        for rank, (i, key) in enumerate(zip(order, keys), 1):
            cost = budget(tokens, r.tokens_per_s[i], int(world[i])) if tokens else ()
            w.writerow([rank, key, f"{r.tokens_per_s[i]:.6g}", f"{r.mfu[i]:.4f}",
                        f"{r.step_time_s[i]:.6g}", f"{r.peak_mem_bytes[i] / GIB:.4g}", "true",
                        "", *(f"{c:.6g}" for c in cost)])
        fh.writelines(_rejected_lines(r, len(extra)))
    tmp.replace(path)


def _rejected_lines(r: Ranking, n_extra: int) -> Iterator[str]:
    """The rejected layouts' CSV lines, as csv.writer writes them. Keyed as feasible ones are
    when their micro-batch count is whole, else by their degrees and micro-batch (the key would
    need a grad_accum they do not have). Built as text from lists: a large space rejects over
    a million layouts, where numpy indexing or csv.writer per row would take most of the time
    (README, the 405B ranking)."""
    a = r.arrays
    rejected = np.flatnonzero(r.reason > 0)
    keyed = rejected[a["ga"][rejected] >= 1]
    keys = dict(zip(keyed.tolist(), row_keys(a, keyed)))
    deg = {k: a[k][rejected].astype(np.int64).tolist() for k in ("dpr", "dps", "tp", "pp", "cp",
                                                                  "mb")}
    mem_gib = (r.peak_mem_bytes[rejected] / GIB).tolist()
    codes = r.reason[rejected].astype(np.int64).tolist()
    tail = {code: _csv_line(["false", reason, *([""] * n_extra)])
            for code, reason in enumerate(REASONS)}  # a reason may hold a comma: quoted
    for j, i in enumerate(rejected.tolist()):
        key = keys.get(i) or degrees_key(*(deg[k][j] for k in ("dpr", "dps", "tp", "pp", "cp"))) \
            + f"_mb{deg['mb'][j]}"
        mem = mem_gib[j]
        yield f",{key},,,,{'' if math.isnan(mem) else f'{mem:.4g}'},{tail[codes[j]]}"


def _csv_line(fields: list[str]) -> str:
    out = io.StringIO()
    csv.writer(out).writerow(fields)
    return out.getvalue()


def _check_options(top: int, world_size: int, optuna: int, margin_gib: float,
                   tokens: float) -> None:
    """The command's own numbers, checked before the (slow) ranking: a negative --top would
    slice from the end, a negative margin would admit layouts past HBM."""
    if top < 0:
        raise ConfigError("--top", top, "a number of layouts to print, >= 0")
    if world_size < 0:
        raise ConfigError("--world-size", world_size,
                          "a number of GPUs >= 1 (0 or absent: cluster.nodes x gpus_per_node)")
    if optuna < 0:
        raise ConfigError("--optuna", optuna, "a number of trials >= 0")
    if not (math.isfinite(margin_gib) and margin_gib >= 0):
        raise ConfigError("--margin-gib", margin_gib, "a non-negative number of GiB")
    if not (math.isfinite(tokens) and tokens >= 0):
        raise ConfigError("--tokens", tokens, "a number of training tokens, e.g. 15e12 (0: none)")


def _print_top(r: Ranking, top: int, tokens: float, world: int) -> None:
    hbm = r.hbm_bytes / GIB
    keys = [r.layout(int(i)).key() for i in r.order[:top]]
    width = max([52] + [len(k) + 2 for k in keys])  # 405B keys run past 52 characters
    cost = f"{f'days for {tokens:.3g}':>18}{'GPU-hours':>11}" if tokens else ""
    print(f"{'#':>3}  {'layout':<{width}}{'tokens/s':>12}{'tok/s/GPU':>11}{'MFU':>7}"
          f"{'mem GiB':>9}{'headroom':>10}{cost}")
    for rank, (i, key) in enumerate(zip(r.order[:top], keys), 1):
        mem = r.peak_mem_bytes[i] / GIB
        cost = ""
        if tokens:
            days, hours = budget(tokens, r.tokens_per_s[i], world)
            cost = f"{days:>18.1f}{hours:>11.4g}"
        print(f"{rank:>3}  {key:<{width}}{r.tokens_per_s[i]:>12.4g}"
              f"{r.tokens_per_s[i] / world:>11.1f}{r.mfu[i]:>7.1%}{mem:>9.1f}"
              f"{hbm - mem:>10.1f}{cost}")


def _rank(cfg: RunConfig, args: argparse.Namespace, world: int, sw: Software) -> int:
    """Rank, print the top and the rejections, write the CSV, optionally search with Optuna:
    exit 1 when nothing fits (a plan with no layout is not a plan)."""
    margin = args.margin_gib * GIB
    r = rank_layouts(cfg.model, cfg.cluster, cfg.train, world, cfg.lowrank, sw,
                     margin_bytes=margin)
    hbm = r.hbm_bytes / GIB
    print(f"{cfg.model.name} on {world} x {cfg.cluster.gpu} ({cfg.cluster.name}), global batch "
          f"{cfg.train.global_batch} x seq {cfg.model.seq_len}, stack {args.stack} "
          f"({sw.precision}{', MFU of the BF16 peak' if args.fp8 else ''}): {len(r)} layouts, "
          f"{len(r.order)} feasible (peak + {args.margin_gib:g} GiB margin within {hbm:.1f} GiB)")
    _print_top(r, args.top, args.tokens, world)
    print("rejected:")
    for reason, n in sorted(r.rejected().items(), key=lambda x: -x[1]):
        print(f"  {n:>9}  {reason}")
    out = args.out or Path(f"plan-{cfg.model.name}-{world}gpu.csv")
    write_ranking(out, r, args.tokens)
    print(f"full ranking: {out}")
    if args.optuna:
        res = optuna_search(cfg.model, cfg.cluster, cfg.train, world, args.optuna,
                            cfg.train.seed, cfg.lowrank, margin_bytes=margin, software=sw)
        best = r.tokens_per_s[r.order[0]] if len(r.order) else float("nan")
        key = res.layout.key() if res.layout else "none feasible"
        print(f"optuna ({res.n_trials} trials, {res.n_infeasible} infeasible): {key} "
              f"{res.tokens_per_s:.4g} tokens/s ({res.tokens_per_s / best:.1%} of exhaustive)")
    return 0 if len(r.order) else 1


def main(argv: list[str]) -> int:
    p = ArgParser(prog="python -m workbench.plan",
                description="Rank every parallel layout with the cost model.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama3_70b")
    p.add_argument("--out", type=Path, default=None, help="ranking CSV (default plan-*.csv)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--world-size", type=int, default=0,
                   help="GPUs (default cluster.nodes * cluster.gpus_per_node)")
    p.add_argument("--optuna", type=int, default=0, help="also run an N-trial Optuna search")
    p.add_argument("--explain", default="", metavar="LAYOUT",
                   help="itemize one layout (a key as the ranking prints it) instead of ranking; "
                        "on a mixed cluster also a run's layout key or `layout` (the config's)")
    p.add_argument("--stages", default="", metavar="TEXT",
                   help="mixed cluster, with --explain: the pools of each stage, e.g. "
                        "'h100:18 | h100+a100:14' (a mixed stage's replicas on both)")
    p.add_argument("--margin-gib", type=float, default=0.0,
                   help="GiB a layout must leave free to count as fitting (ranking, --optuna, "
                        "--explain)")
    p.add_argument("--tokens", type=float, default=0.0, metavar="T",
                   help="a training budget in tokens (15e12): days and GPU-hours per layout")
    p.add_argument("--stack", default="workbench", metavar="NAME",
                   help="the training stack to plan for: " + ", ".join(STACKS))
    p.add_argument("--stack-fact", action="append", default=[], metavar="KEY=VALUE",
                   help="a fact where your run differs from the stack's defaults, as a "
                        "published row's fact column says it (repeatable; e.g. "
                        "grad_buffer_bits=16; docs/planner.md 'Stack facts')")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 linears (Transformer Engine on megatron, torchao on torchtitan)")
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise InputError(f"override {bad[0]!r}: use key=value (e.g. model=llama3_70b)")
    _check_options(args.top, args.world_size, args.optuna, args.margin_gib, args.tokens)
    cfg = compose(args.overrides)
    world = args.world_size or cfg.cluster.nodes * cfg.cluster.gpus_per_node
    facts = plan_facts(args.stack_fact)
    sw = stack_software(args.stack, cfg.train, cfg.cluster, args.fp8, facts)
    args.stack = "+".join([args.stack, *args.stack_fact])  # as the reports name it
    stack = f"{args.stack} ({sw.precision})"
    if cfg.cluster.pools and args.fp8:
        check_fp8(pools_of(cfg.cluster))
    if args.explain and cfg.cluster.pools:  # a mixed cluster: one pipeline over pools
        print("\n".join(render_pools(explain_pools(
            cfg.model, cfg.cluster, cfg.train, args.explain, args.stages, cfg.lowrank,
            args.margin_gib * GIB, sw, cfg.layout, cfg.launcher.stage_pools), stack)))
        return 0
    if args.stages:
        raise ConfigError("--stages", args.stages, "only with --explain on a mixed cluster "
                                                   "(cluster.pools)")
    if args.explain:
        x = explain(cfg.model, cfg.cluster, cfg.train, args.explain, cfg.lowrank, args.margin_gib,
                    world, sw)
        print(f"stack {args.stack} ({sw.precision})")
        print("\n".join(render(x)))
        if args.tokens:
            rate = cfg.train.global_batch * cfg.model.seq_len / x.step_time_s
            days, hours = budget(args.tokens, rate, x.layout.world_size)
            print(f"{args.tokens:.4g} tokens: {days:.1f} days, {hours:.4g} GPU-hours")
        return 0
    if cfg.cluster.pools:  # a mixed cluster: stages placed on pools (workbench.plan.pools)
        return pool_main(cfg, args.out, args.top, args.margin_gib, sw, stack)
    return _rank(cfg, args, world, sw)


if __name__ == "__main__":
    sys.exit(guarded(main)(sys.argv[1:]))
