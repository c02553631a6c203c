"""`python -m workbench.plan ... cluster=<a cluster with pools>`: the ranking over pools.

Prints the best layouts with the pool and layer count of every stage, the best layout on a single
pool beside them (is the slow pool worth its link?), why the rest were rejected, and writes the
full ranking to a CSV.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from workbench.plan.cost.hardware import GIB
from workbench.plan.cost.software import Software
from workbench.plan.pools.search import HeteroRanking, rank_pools, speedup, world_of


def write_pool_ranking(path: Path, r: HeteroRanking) -> None:
    """Feasible layouts best first, then the rejected ones with their reason (via a temp file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["rank", "layout", "stages", "gpus", "tokens_per_s", "step_time_s",
                    "mem_frac", "rejected_because"])
        for rank, i in enumerate(r.order, 1):
            w.writerow([rank, r.key(i), r.stages(i), world_of(r, i),
                        f"{r.tokens_per_s[i]:.6g}", f"{r.step_time_s[i]:.6g}",
                        f"{r.mem_frac[i]:.4f}", ""])
        for i in range(len(r)):
            if r.reason[i]:
                w.writerow(["", r.key(i), " | ".join(r.uses(i)), world_of(r, i), "", "", "",
                            r.reason[i]])
    tmp.replace(path)


def _row(rank: str, r: HeteroRanking, i: int) -> str:
    return (f"{rank:>3}  {r.key(i):<26}{r.stages(i):<40}{world_of(r, i):>5}"
            f"{r.tokens_per_s[i]:>12.4g}{r.step_time_s[i]:>10.4g}{r.mem_frac[i]:>8.0%}")


def pool_main(cfg: Any, out: Path | None, top: int, margin_gib: float = 0.0,
              software: Software | None = None, stack: str = "") -> int:
    """Rank, print and write the layouts of cfg.model on cfg.cluster's pools (priced with
    `software`, the stack's; `stack` names it in the header)."""
    r = rank_pools(cfg.model, cfg.cluster, cfg.train, cfg.lowrank, software,
                   margin_bytes=margin_gib * GIB)
    desc = " + ".join(f"{p.nodes}x{p.spec.gpus_per_node} {p.spec.name} ({p.name})"
                      for p in r.pools)
    print(f"{cfg.model.name} on pools {desc}, global batch {cfg.train.global_batch} x seq "
          f"{cfg.model.seq_len}{', stack ' + stack if stack else ''}: {len(r)} layouts, "
          f"{len(r.order)} feasible ({sum(r.mixed(int(i)) for i in r.order)} with a mixed "
          "stage)")
    if margin_gib:
        print(f"fits: every stage's peak + {margin_gib:g} GiB margin within its GPUs' memory "
              "(mem: the share of memory less the margin)")
    print(f"{'#':>3}  {'layout':<26}{'stages (pool:layers per stage)':<40}{'GPUs':>5}"
          f"{'tokens/s':>12}{'step s':>10}{'mem':>8}")
    for rank, i in enumerate(r.order[:top], 1):
        print(_row(str(rank), r, int(i)))
    one = r.best_single_pool()
    if one is None:
        print("best single-pool layout: none feasible")
    else:
        rank = int(list(r.order).index(one)) + 1
        print(f"best single-pool layout (rank {rank}; the best overall is "
              f"{speedup(r):.2f}x faster):" if rank > 1 else
              f"best single-pool layout: the best layout itself (pool {r.uses(one)[0]}):")
        print(_row(str(rank), r, one))
    print("rejected:")
    for reason, n in sorted(r.rejected().items(), key=lambda x: -x[1]):
        print(f"  {n:>9}  {reason}")
    path = out or Path(f"plan-{cfg.model.name}-{cfg.cluster.name}.csv")
    write_pool_ranking(path, r)
    print(f"full ranking: {path}")
    return 0 if len(r.order) else 1
