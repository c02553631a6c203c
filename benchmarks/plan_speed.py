"""Speed of exhaustive layout scoring on one core: layouts scored per second and total time.

    python benchmarks/plan_speed.py        (targets: >= 1,000,000 layouts/s; 405B space < 10 s)

The space holds every pipeline once per candidate stage split (workbench.plan.search.splits); the
baseline, measured in the same run, is the even-split space alone (the space before uneven
stages), so the ratio shows what the splits cost per layout.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says

from workbench.compose import compose
from workbench.plan.search.exhaustive import rank_layouts, score
from workbench.plan.search.space import enumerate_space

CASES = (("llama3_405b", 16384, 2048), ("llama3_70b", 1024, 1024))


def main() -> int:
    warm = compose(["model=llama3_8b", "cluster=h100_8x_ib", "train.dtype=bf16"])
    rank_layouts(warm.model, warm.cluster, warm.train, 8)  # first-call import/alloc costs
    for model, world, gb in CASES:
        cfg = compose([f"model={model}", "cluster=h100_8x_ib", f"train.global_batch={gb}",
                       "train.dtype=bf16"])
        t0, c0 = time.perf_counter(), time.process_time()
        r = rank_layouts(cfg.model, cfg.cluster, cfg.train, world)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        c1 = time.process_time()
        even = score(cfg.model, cfg.cluster, cfg.train, enumerate_space(world))
        cpu_even = time.process_time() - c1
        best = r.layout(int(r.order[0])).key() if len(r.order) else "none feasible"
        rate, rate_even = len(r) / max(cpu, 1e-9), len(even) / max(cpu_even, 1e-9)
        print(f"{model} on {world} H100 (global batch {gb}): {len(r):,} layouts "
              f"({len(r.order):,} feasible) in {dt:.2f} s = {len(r) / dt:,.0f} layouts/s wall, "
              f"{rate:,.0f} layouts/s of CPU time ({cpu:.2f} s); best {best}")
        print(f"  baseline, even splits only: {len(even):,} layouts in {cpu_even:.2f} s CPU = "
              f"{rate_even:,.0f} layouts/s; with uneven splits {rate / rate_even:.2f}x per layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
