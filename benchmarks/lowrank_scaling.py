"""Data-parallel scaling where bytes are the bottleneck: full rank vs adaptive low rank vs fixed
low rank vs PowerSGD at world sizes 1, 2 and 4, the ranks talking only over a `tc`-limited link,
next to the cost model's prediction for that link.

    sudo python benchmarks/lowrank_scaling.py [--rate-mbit 1000] [--steps 20] [--quick]
                                              [--modes off,adaptive,fixed,powersgd]
                                              [--worlds 1,2,4] [--repeat 1]
                                              [--json OUT] [--record]
    python benchmarks/lowrank_scaling.py --combine A.json B.json   (runs split by mode)

Each rank runs in its own network namespace behind one veth NIC limited to --rate-mbit in both
directions (workbench.testing.netns), DDP over gloo. The model is gpt_small (14.3M parameters,
57 MB of fp32 gradients a step) at seq_len 128 and 2 sequences per rank and step (the per-rank
batch is fixed, so ideal scaling is N x the tokens/s of one rank). On 2 CPU cores one rank
computes a step in ~0.5 s while 1 Gbit/s moves its gradients in ~0.5 s: full rank is
communication-bound there. Every rank gets one intra-op thread (launch.world.threads_per_rank
for 2 or 4 ranks on 2 cores); at world size 4 the ranks share 2 cores, so compute alone takes
2x as long and efficiency cannot exceed 50% on this machine (the prediction includes that).

Measured: median step time over the steps after the low-rank switch / PowerSGD's start; bytes
per step and collectives per step as the engine's ByteCounter counts them. Predicted
(workbench.lowrank.dp_scaling): the step at world size 1 is the measured one (per mode: a
factorized model computes faster; for PowerSGD, plus its hook's compute, measured by one-rank
DDP with and without the hook in turns, since the hook only runs with more than one rank), N
ranks taking the slowest of N one-rank steps (the measured one-rank step times' 0.5 ** (1/N)
quantile), every collective paying the latency of a 4 KB all-reduce measured over the link at
that world size; the all-reduce time, its overlap with the backward, the bytes (from the
model's shape, fixed and adaptive at rank_ratio), the collectives (DDP's bucket layout) and the
CPU oversubscription are the model's, the cores counted as those left free of other jobs while
each point was measured (CpuShare; printed as "free"). The check: predicted
tokens/s within 20% of measured, where a world size beyond 2 is scored on its prediction out of
sample: made from what 1 and 2 ranks measured (the cores the 2-rank run had) and the link's own
4 KB all-reduce at that size (measured over the link before the run, nothing computing),
printed beside the in-sample one that counts the cores the N-rank run itself had (exit 1 when
it fails; --quick prints no verdict). --record
stores the measured points with the chart's data (workbench/lowrank/dp_measured.json) for
`python -m workbench.lowrank.dp_chart`.

Needs root (network namespaces, tc): otherwise one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from lowrank_scaling_report import MICRO_BATCH, MODEL, predict_all, report


def mode_overrides(mode: str, steps: int) -> List[str]:
    """Switch early (10-20% of the run) so most steps are timed in the mode's steady state."""
    return [f"lowrank={mode}", "lowrank.switch_frac=0.1", "lowrank.min_switch_frac=0.05",
            "lowrank.max_switch_frac=0.2", "lowrank.check_every=1",
            f"lowrank.powersgd_start_iter={max(2, steps // 10)}"]


def timed(history: List[Dict[str, float]], first: int) -> Dict[str, float]:
    rows = history[first:] or history
    return {"step_s": statistics.median(h["step_time_s"] for h in rows),
            "bytes": max(h.get("comm/bytes_per_step", 0.0) for h in rows[-1:]),
            "trainable": rows[-1].get("params/trainable", 0.0),
            "collectives": statistics.median(h.get("comm/collectives_per_step", 0.0)
                                             for h in rows),
            "step_samples": [h["step_time_s"] for h in rows]}


def copy_bytes_per_s(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Memory bandwidth of one thread (bytes read + written per second by a tensor copy of
    gradient size): what PowerSGD's memory-bound hook runs at."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (time.perf_counter() - t0)


def powersgd_hook_s(cfg: Any, steps: int = 12) -> float:
    """Seconds PowerSGD's hook adds to one rank's step, measured: replication over a one-rank
    gloo group with and without workbench's PowerSGD hook, in one bucket as the engine runs it
    (over one rank its all-reduces move nothing, so the difference is the compression's
    compute). The engine does not replicate one process, hence this separate measurement. The
    two models step in turn and the figure is the median of the paired differences: other jobs
    that come and go on the shared cores then slow both sides of a pair alike (measured one
    after the other, the two medians once differed by nothing at all under load)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._composable.replicate import replicate

    from workbench.lowrank.powersgd import PowerSGD, hook
    from workbench.train.model import build
    from workbench.train.parallel.parallelize import ONE_BUCKET_MB

    store = dist.FileStore(tempfile.mktemp(prefix="wb-hook-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        models = [replicate(build(cfg.model, cfg.train.seed), bucket_cap_mb=ONE_BUCKET_MB)
                  for _ in range(2)]
        models[1].register_comm_hook(PowerSGD(models[1], None, cfg.lowrank.powersgd_rank, 2,
                                              cfg.train.seed), hook)
        x = torch.randint(0, cfg.model.vocab, (MICRO_BATCH, cfg.model.seq_len + 1))
        diffs = []
        for i in range(steps):
            pair = []
            for model in models:
                t0 = time.perf_counter()
                logits = model(x[:, :-1])
                F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
                pair.append(time.perf_counter() - t0)
            if i >= 3:  # PowerSGD starts at its iteration 2; the reducer rebuilds after the first
                diffs.append(pair[1] - pair[0])
        return max(0.0, statistics.median(diffs))
    finally:
        dist.destroy_process_group()


def measure(modes: List[str], worlds: List[int], steps: int, rate_mbit: float,
            rate_check: bool) -> Dict[str, Any]:
    import torch

    from workbench import layout as layouts
    from workbench.compose import compose
    from workbench.config import LauncherConfig
    from workbench.data.corpus import load as load_data
    from workbench.launch.world import cores, threads_per_rank
    from workbench.testing.cpushare import CpuShare
    from workbench.testing.multirank import Case, run_cases, run_single
    from workbench.testing.netns import LimitedLink, probe_bytes_per_s, small_allreduce_s

    first = max(2, steps * 2 // 5)  # the switches land by 20%; DDP re-wraps settle after
    base = MODEL + [f"train.steps={steps}", f"train.micro_batch={MICRO_BATCH}"]
    cfgs = {(m, n): compose(base + mode_overrides(m, steps)
                            + [f"train.global_batch={MICRO_BATCH * n}"])
            for m in modes for n in worlds}
    data = load_data(cfgs[modes[0], worlds[0]].data)
    root = tempfile.mkdtemp(prefix="wb-scaling-")
    out: Dict[str, Any] = {"points": {}, "probe_mbit": {}, "cores": cores(),
                           "seq_len": cfgs[modes[0], worlds[0]].model.seq_len}
    torch.set_num_threads(1)  # one rank's share, as every spawned rank below
    out["host_copy_bytes_per_s"] = copy_bytes_per_s()
    if "powersgd" in modes:
        # as many paired steps as the runs take, at most 12 (--quick: 8, 5 pairs after warm-up)
        out["powersgd_hook_s"] = powersgd_hook_s(cfgs["powersgd", worlds[0]], min(12, steps))
        print(f"  PowerSGD hook (measured, one rank): {out['powersgd_hook_s']:.3f} s/step",
              flush=True)
    for n in worlds:
        share = threads_per_rank(LauncherConfig(name="torchrun", nproc_per_node=n))
        print(f"  world {n}: threads_per_rank {share}, the ranks run 1 thread each", flush=True)
    for m in modes:
        if m == "powersgd" and "off" in modes:  # one process has nothing to compress
            continue
        c = cfgs[m, 1]
        with CpuShare(out["cores"]) as share:
            r = run_single(c, layouts.resolve(c.layout, c.train, 1), data, f"{root}/w1-{m}")
        out["points"][f"{m}/1"] = {**timed(r["history"], first), "free_cores": share.free}
        print(f"  world 1 {m}: {out['points'][f'{m}/1']['step_s']:.3f} s/step, "
              f"{share.free:.2f} of {out['cores']} cores free of other jobs", flush=True)
    if "powersgd" in modes and "off" in modes:
        out["points"]["powersgd/1"] = dict(out["points"]["off/1"])
    for n in [w for w in worlds if w > 1]:
        cases = [Case(m, cfgs[m, n], layouts.resolve(cfgs[m, n].layout, cfgs[m, n].train, n),
                      "") for m in modes]
        with LimitedLink(n, rate_mbit) as link:
            out["probe_mbit"][str(rate_mbit)] = probe_bytes_per_s(link) * 8 / 1e6
            out.setdefault("collective_s", {})[str(n)] = small_allreduce_s(link)
            print(f"  world {n}: a 4 KB all-reduce over the link takes "
                  f"{1e3 * out['collective_s'][str(n)]:.2f} ms (median, nothing computing)",
                  flush=True)
            with CpuShare(out["cores"]) as share:
                results = run_cases(n, cases, data, f"{root}/w{n}", timeout_s=1200,
                                    netns=link.namespaces)
            out.setdefault("link_counters", {})[str(n)] = link.counters()
            for m, r in zip(modes, results):
                if "error" in r:
                    raise RuntimeError(f"world {n} {m}: {r['error']}\n{r.get('traceback')}")
                out["points"][f"{m}/{n}"] = {**timed(r["history"], first),
                                             "free_cores": share.free}
                print(f"  world {n} {m}: {out['points'][f'{m}/{n}']['step_s']:.3f} s/step, "
                      f"{share.free:.2f} of {out['cores']} cores free of other jobs", flush=True)
            if rate_check and n == 2 and "off" in modes:  # does the step follow the tc rate?
                fast = 4 * rate_mbit
                link.set_rate(fast)
                out["probe_mbit"][str(fast)] = probe_bytes_per_s(link) * 8 / 1e6
                r = run_cases(n, cases[:1], data, f"{root}/w{n}-fast", timeout_s=600,
                              netns=link.namespaces)[0]
                out["rate_check"] = {"rate_mbit": fast, **timed(r["history"], first)}
    return out


def repeated(modes: List[str], worlds: List[int], steps: int, rate_mbit: float,
             rate_check: bool, repeat: int) -> Dict[str, Any]:
    """measure() `repeat` times; each point's step is the median over the repeats (the
    spread is printed and kept under "repeats": the cores are shared with other jobs)."""
    runs = [measure(modes, worlds, steps, rate_mbit, rate_check and i == 0)
            for i in range(repeat)]
    out = runs[0]
    if repeat > 1:
        out["repeats"] = {k: [[r["points"][k]["step_s"], r["points"][k]["free_cores"]]
                              for r in runs] for k in out["points"]}
        for k, v in out["repeats"].items():
            out["points"][k]["step_s"] = statistics.median(x[0] for x in v)
            out["points"][k]["free_cores"] = statistics.median(x[1] for x in v)
            print(f"  {k}: " + ", ".join(f"{x[0]:.3f} s/step ({x[1]:.2f} cores free)"
                                         for x in v), flush=True)
    return out


def combine(paths: List[Path], dest: Optional[Path] = None) -> int:
    """One chart record (into `dest`, default the chart's) from runs of disjoint modes at the
    same rate, steps and world sizes: every row keeps the prediction made from its own run's
    one-rank step, link latency and hook time (each row carries them), so nothing is mixed
    across runs."""
    from workbench.lowrank.dp_chart import MEASURED

    parts = [json.loads(p.read_text()) for p in paths]
    keys = [(r["mode"], r["world"]) for p in parts for r in p["rows"]]
    same = {(p["rate_mbit"], p["steps"]) for p in parts}
    if len(set(keys)) != len(keys) or len(same) != 1:
        print("lowrank_scaling: --combine takes runs of different modes at one --rate-mbit "
              f"and --steps; got rows {keys} and (rate, steps) {sorted(same)}", file=sys.stderr)
        return 2
    out = dict(parts[0])
    out["rows"] = [r for p in parts for r in p["rows"]]
    out["points"] = {k: v for p in parts for k, v in p["points"].items()}
    kept = ("when", "load", "collective_s", "powersgd_hook_s", "link_counters")
    out["parts"] = [{**{k: p.get(k) for k in kept},
                     "modes": sorted({r["mode"] for r in p["rows"]})} for p in parts]
    ok = report(out["rows"], out, out["rate_mbit"])
    dest = dest or MEASURED
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded: {dest}")
    return 0 if ok else 1


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true",
                    help="PowerSGD (the mode with every term) at world sizes 1 and 2, 8 steps "
                         "(the README test)")
    ap.add_argument("--modes", default="off,adaptive,fixed,powersgd")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure every point this many times; the table shows the median")
    ap.add_argument("--json", default="")
    ap.add_argument("--record", action="store_true",
                    help="store the measured points for the scaling chart")
    ap.add_argument("--combine", nargs="+", default=[], metavar="JSON",
                    help="record the --json outputs of runs split by mode (each under 5 "
                         "minutes on shared cores) as one record (into --json if given, else "
                         "the chart's), measuring nothing")
    a = ap.parse_args(argv)
    if a.combine:
        return combine([Path(f) for f in a.combine], Path(a.json) if a.json else None)
    from workbench.testing.netns import unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"lowrank_scaling: the rate-limited link {why}; run it as root", file=sys.stderr)
        return 2
    modes = ["powersgd"] if a.quick else a.modes.split(",")
    worlds = [1, 2] if a.quick else [int(w) for w in a.worlds.split(",")]
    bad = [m for m in modes if m not in ("off", "adaptive", "fixed", "powersgd")]
    if bad or 1 not in worlds or any(w < 1 for w in worlds) or a.repeat < 1:
        print(f"lowrank_scaling: --modes takes off,adaptive,fixed,powersgd, --worlds must "
              f"include 1 (the baseline), --repeat >= 1; got {a.modes!r} {a.worlds!r} "
              f"{a.repeat}", file=sys.stderr)
        return 2
    steps = 8 if a.quick else a.steps
    load = os.getloadavg()
    print(f"gpt_small (seq 128, {MICRO_BATCH} sequences per rank and step), {steps} steps, DDP "
          f"over gloo, each rank behind a {a.rate_mbit:g} Mbit/s tc-limited veth NIC; "
          f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    t0 = time.time()
    out = repeated(modes, worlds, steps, a.rate_mbit, not a.quick and 2 in worlds, a.repeat)
    rows = predict_all(out, modes, worlds, a.rate_mbit)
    ok = report(rows, out, a.rate_mbit, verdict=not a.quick)
    load = os.getloadavg()
    print(f"wall-clock {time.time() - t0:.0f} s; load average after: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (other jobs on the 2 cores add noise)")
    result = {"rate_mbit": a.rate_mbit, "steps": steps, "rows": rows, **out,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": load}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.record:
        from workbench.lowrank.dp_chart import MEASURED

        MEASURED.write_text(json.dumps(result, indent=1) + "\n")
        print(f"recorded for the chart: {MEASURED}")
    return 0 if ok else 1  # the verdict above: exit 1 when it failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
