"""What a small collective costs between ranks that compute, and what that did to PowerSGD.

    sudo python benchmarks/lowrank_sync_probe.py wait [--busy-ms 0,20] [--iters 150]
    sudo python benchmarks/lowrank_sync_probe.py buckets [--rounds 2] [--steps 16]

Why: PowerSGD measured 43-49% slower at 2 and 4 ranks than the cost model predicted, while a
4 KB all-reduce over the tc-limited link was once timed at 4 ms against the model's 0.2 ms.

- wait: 2 ranks, a blocking 4 KB gloo all-reduce, over loopback (no namespaces, no tc) and over
  the 1 Gbit/s tc-limited veth link, with each rank first computing --busy-ms of matmuls (0:
  back to back). If the link made small collectives slow, the link would be slower than
  loopback with the ranks idle; if what costs is waiting for a peer that was descheduled or
  started late (2 ranks and other jobs on 2 cores), the time grows with the compute between
  collectives on both paths alike.
- buckets: PowerSGD on gpt_small at 2 ranks over the link, DDP's 25 MB buckets (the hook
  blocks once per bucket: 3 all-reduces each, inside the backward) against one bucket (3 in a
  row after the backward), the two cases taking turns in one process group so that other
  jobs' load falls on both. Printed: median step, collectives per step (the engine's count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import List, Optional

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workbench.testing.netns import timed_allreduce_child


def _wait_once(busy_ms: float, iters: int, link: Optional[object]) -> List[float]:
    import json

    store = tempfile.mktemp(prefix="wb-wait-")
    out = tempfile.mktemp(prefix="wb-wait-", suffix=".json")
    ns = getattr(link, "namespaces", None)
    mp.spawn(timed_allreduce_child, args=(2, store, ns, 4096, iters, out, busy_ms), nprocs=2,
             join=True)
    with open(out) as f:
        return sorted(json.load(f))


def wait(busy: List[float], iters: int, rate_mbit: float) -> None:
    from workbench.testing.netns import LimitedLink

    for ms in busy:
        for name in ("loopback", f"tc {rate_mbit:g} Mbit/s veth"):
            if name == "loopback":
                r = _wait_once(ms, iters, None)
            else:
                with LimitedLink(2, rate_mbit) as link:
                    r = _wait_once(ms, iters, link)
            print(f"4 KB all-reduce, 2 ranks, {ms:g} ms of compute before each, {name}: median "
                  f"{1e3 * statistics.median(r):.2f} ms, p90 {1e3 * r[9 * len(r) // 10]:.2f}, "
                  f"max {1e3 * r[-1]:.1f}", flush=True)


def buckets(rounds: int, steps: int, rate_mbit: float) -> None:
    from lowrank_scaling import MICRO_BATCH, MODEL, mode_overrides

    from workbench import layout as layouts
    from workbench.compose import compose
    from workbench.data.corpus import load as load_data
    from workbench.testing.multirank import Case, run_cases
    from workbench.testing.netns import LimitedLink

    first = max(2, steps * 2 // 5)
    cfgs = {one: compose(MODEL + [f"train.steps={steps}", f"train.micro_batch={MICRO_BATCH}",
                                  f"train.global_batch={2 * MICRO_BATCH}"]
                         + mode_overrides("powersgd", steps)
                         + [f"lowrank.powersgd_one_bucket={one}"]) for one in (False, True)}
    cases = [Case(f"one_bucket={one}", cfgs[one],
                  layouts.resolve(cfgs[one].layout, cfgs[one].train, 2), "")
             for _ in range(rounds) for one in (False, True)]
    data = load_data(cfgs[True].data)
    with LimitedLink(2, rate_mbit) as link:
        results = run_cases(2, cases, data, tempfile.mkdtemp(prefix="wb-buckets-"),
                            timeout_s=1200, netns=link.namespaces)
    for case, r in zip(cases, results):
        if "error" in r:
            raise RuntimeError(f"{case.name}: {r['error']}")
        rows = r["history"][first:]
        print(f"PowerSGD, 2 ranks, {case.name}: median step "
              f"{statistics.median(h['step_time_s'] for h in rows):.3f} s, "
              f"{statistics.median(h['comm/collectives_per_step'] for h in rows):.0f} "
              f"collectives per step, {rows[-1]['comm/bytes_per_step'] / 1e6:.2f} MB",
              flush=True)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["wait", "buckets"])
    ap.add_argument("--busy-ms", default="0,20")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    a = ap.parse_args(argv)
    from workbench.testing.netns import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"lowrank_sync_probe: the rate-limited link {why}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if a.what == "wait":
        wait([float(x) for x in a.busy_ms.split(",")], a.iters, a.rate_mbit)
    else:
        buckets(a.rounds, a.steps, a.rate_mbit)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
