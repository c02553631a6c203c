"""Step time and tokens/s of every layout at world size 2 on the CPU (gloo), against the
single-process run of the same model and global batch.

    python benchmarks/parallel_cpu.py [--steps 10] [--global-batch 16] [--json out.json]

All layouts run inside one spawned 2-rank group (workbench.testing.multirank), one intra-op
thread per rank, so the two ranks share the cores the single process uses with 2 threads.
Times are medians over the steps after the first (which pays for lazy initialisation).
Loss error is the largest relative difference of per-step losses from the single run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from workbench import layout as layouts
from workbench.compose import compose
from workbench.data.corpus import load as load_data
from workbench.plan.search.rules import validate_layout
from workbench.testing.multirank import (
    Case,
    max_rel_loss_err,
    median_after_first,
    run_cases,
    run_single,
)

LAYOUTS: Dict[str, List[str]] = {
    "ddp": ["layout=ddp"],
    "fsdp": ["layout=fsdp"],
    "tp": ["layout=tp"],
    "tp+sp": ["layout=tp", "layout.sequence_parallel=true"],
    "pp gpipe": ["layout=pp", "layout.pp_schedule=gpipe"],
    "pp 1f1b": ["layout=pp", "layout.pp_schedule=1f1b"],
    "pp interleaved v2": ["layout=pp", "layout.pp_schedule=interleaved_1f1b",
                          "layout.virtual_stages=2"],
    "cp (all-gather K/V)": ["layout.cp=2"],
    "ddp recompute=full": ["layout=ddp", "layout.recompute=full"],
    "fsdp recompute=full": ["layout=fsdp", "layout.recompute=full"],
}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    base = ["model=gpt_tiny", f"train.steps={args.steps}",
            f"train.global_batch={args.global_batch}", f"train.micro_batch={args.micro_batch}",
            "train.eval_every=100000", "train.eval_batches=1", "train.ckpt_every=100000",
            "tracking=none", "data.max_bytes=1000000"]
    root = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    cfg = compose(base)
    data = load_data(cfg.data)
    single = run_single(cfg, layouts.resolve(cfg.layout, cfg.train, 1), data,
                        str(root / "single"))
    cases = []
    for name, overrides in LAYOUTS.items():
        c = compose(base + overrides)
        layout = layouts.resolve(c.layout, c.train, 2)
        validate_layout(layout, c.model, 2)
        cases.append(Case(name, c, layout, str(root / name.replace(" ", "_"))))
    results = run_cases(2, cases, data, str(root / "ranks"), timeout_s=1800)

    ref_step = median_after_first(single["history"], "step_time_s")
    ref_losses = [h["loss"] for h in single["history"]]
    rows = [{"layout": "single (1 process)", "key": "-", "step_time_s": ref_step,
             "tokens_per_s": median_after_first(single["history"], "tokens_per_s"),
             "ratio": 1.0, "comm_bytes_per_step": 0.0, "max_rel_loss_err": 0.0}]
    for case, res in zip(cases, results):
        if "error" in res:
            rows.append({"layout": case.name, "key": case.layout.key(), "error": res["error"]})
            continue
        step = median_after_first(res["history"], "step_time_s")
        err = max_rel_loss_err(res["history"], ref_losses)
        rows.append({"layout": case.name, "key": case.layout.key(), "step_time_s": step,
                     "tokens_per_s": median_after_first(res["history"], "tokens_per_s"),
                     "ratio": ref_step / step,
                     "comm_bytes_per_step": res["history"][-1]["comm/bytes_per_step"],
                     "max_rel_loss_err": err})
    print(f"gpt_tiny, global batch {args.global_batch} x seq {cfg.model.seq_len}, micro-batch "
          f"{args.micro_batch}, {args.steps} steps, world size 2 (gloo) vs 1 process")
    print(f"{'layout':<22} {'step_time_s':>11} {'tokens/s':>9} {'vs single':>9} "
          f"{'comm MB/step':>12} {'loss rel err':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:<22} ERROR {r['error']}")
            continue
        print(f"{r['layout']:<22} {r['step_time_s']:>11.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['ratio']:>8.2f}x {r['comm_bytes_per_step'] / 1e6:>12.2f} "
              f"{r['max_rel_loss_err']:>12.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
