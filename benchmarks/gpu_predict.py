"""The planner on one device it has just profiled: predict, then measure, one-rank layouts.

    python benchmarks/gpu_predict.py cluster=gpu model=gpt2_124m [overrides] \
        [--datasheet local_gpu] [--micro-batches 4 8 16] [--steps 20] [--device cuda]

`cluster=` names a profiled cluster file (`python -m workbench.profile ... --name gpu` writes
conf/cluster/gpu.yaml); `--datasheet` names the shipped cluster it was profiled from, whose
datasheet figures are the baseline priced in the same run. Every layout is a world of one
(each micro-batch size, with and without full recomputation) run through the real engine and
loop in this process; measured: the median step after the first. All of them are held out:
nothing in the cost model was chosen looking at a GPU's measurements. Prints each layout's
figures, the median error from the profile and from the datasheet and their ratio; no verdict
(no threshold has been set on a GPU yet).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from typing import List

from workbench import layout as layouts
from workbench.compose import compose
from workbench.data.corpus import load as load_data
from workbench.plan.cost.estimate import estimate
from workbench.testing.multirank import median_after_first, run_single


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasheet", default="local_gpu")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args, overrides = ap.parse_known_args(argv)
    rows = []
    print(f"{'layout':<22} {'measured s':>11} {'profile s':>10} {'err':>7} "
          f"{'datasheet s':>12} {'err':>7}")
    for mb in args.micro_batches:
        for rc in ("none", "full"):
            run = overrides + [f"train.micro_batch={mb}", f"train.global_batch={mb}",
                               f"train.steps={args.steps}", f"layout.recompute={rc}",
                               "train.eval_every=100000", "train.ckpt_every=100000",
                               "tracking=none"]
            cfg = compose(run)
            base = compose(run + [f"cluster={args.datasheet}"])
            layout = layouts.resolve(cfg.layout, cfg.train, 1)
            with tempfile.TemporaryDirectory() as ckpt:
                out = run_single(cfg, layout, load_data(cfg.data), ckpt, args.device)
            measured = median_after_first(out["history"], "step_time_s")
            prof = estimate(cfg.model, cfg.cluster, cfg.train, layout).step_time_s
            sheet = estimate(base.model, base.cluster, base.train, layout).step_time_s
            rows.append((prof / measured - 1, sheet / measured - 1))
            print(f"{f'mb{mb} recompute={rc}':<22} {measured:>11.4f} {prof:>10.4f} "
                  f"{rows[-1][0]:>+7.1%} {sheet:>12.4f} {rows[-1][1]:>+7.1%}", flush=True)
    prof_err = statistics.median(abs(p) for p, _ in rows)
    sheet_err = statistics.median(abs(s) for _, s in rows)
    print(f"median |error|: profile {prof_err:.1%}, datasheet {sheet_err:.1%} "
          f"(profile / datasheet = {prof_err / max(sheet_err, 1e-9):.2f}), {len(rows)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
