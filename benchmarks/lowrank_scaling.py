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
tokens/s within 20% of measured (exit 1 when it fails; --quick prints no verdict). --record
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

MODEL = ["model=gpt_small", "model.seq_len=128", "data.max_bytes=1000000", "tracking=none",
         "layout=ddp", "train.eval_every=100000", "train.eval_batches=1",
         "train.ckpt_every=100000", "train.warmup_steps=2"]
MICRO_BATCH = 2  # sequences per rank and step


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


def predict_all(out: Dict[str, Any], modes: List[str], worlds: List[int],
                rate_mbit: float) -> List[Dict[str, Any]]:
    from workbench.compose import compose
    from workbench.lowrank.dp_scaling import collectives, cpu_prediction, model_shape
    from workbench.lowrank.dp_scaling import powersgd_hook_s as hook_model

    model = compose(MODEL).model
    out["hook_model_s"] = hook_model(model_shape(model, None), out["host_copy_bytes_per_s"])
    rows = []
    for m in modes:
        for n in worlds:
            p = out["points"][f"{m}/{n}"]
            one = out["points"][f"{m}/1"]
            pr = cpu_prediction(model, m, one["step_s"], n, rate_mbit,
                                p.get("free_cores", out["cores"]), out.get("powersgd_hook_s", 0.0),
                                one.get("free_cores", out["cores"]),
                                one.get("step_samples", ()),
                                out.get("collective_s", {}).get(str(n)))
            tok = MICRO_BATCH * n * model.seq_len
            rows.append({"mode": m, "world": n, "step_s": p["step_s"],
                         "collective_s": out.get("collective_s", {}).get(str(n)),
                         "hook_s": out.get("powersgd_hook_s", 0.0),
                         "tokens_per_s": tok / p["step_s"], "bytes": p["bytes"],
                         "pred_bytes": pr.payload_bytes if n > 1 else 0.0,
                         "pred_step_s": pr.step_s, "pred_tokens_per_s": tok / pr.step_s,
                         "pred_efficiency": pr.efficiency,
                         "collectives": p.get("collectives", 0.0),
                         "pred_collectives": collectives(pr.payload_bytes, kind(m))
                         if n > 1 else 0,
                         "free_cores": p.get("free_cores", out["cores"])})
    one = {r["mode"]: r["tokens_per_s"] for r in rows if r["world"] == 1}
    for r in rows:
        r["efficiency"] = r["tokens_per_s"] / (r["world"] * one[r["mode"]])
        r["error_pct"] = 100 * (r["pred_tokens_per_s"] / r["tokens_per_s"] - 1)
    return rows


def kind(mode: str) -> str:
    """The cost model's name for a benchmark mode (adaptive and fixed both train low rank)."""
    return {"adaptive": "lowrank", "fixed": "lowrank"}.get(mode, mode)


def report(rows: List[Dict[str, Any]], out: Dict[str, Any], rate_mbit: float,
           verdict: bool = True) -> bool:
    """The table and, unless `verdict` is off (a smoke test), the PASS/FAIL lines; whether
    every check passed."""
    print(f"\n{'mode':<9} {'N':>2} {'free':>4} {'MB/step':>8} {'pred MB':>8} {'s/step':>7} "
          f"{'tokens/s':>9} {'eff':>5} {'coll':>4} | {'coll':>4} {'pred s':>7} "
          f"{'pred tok/s':>10} {'pred eff':>8} {'err':>6}")
    for r in rows:
        print(f"{r['mode']:<9} {r['world']:>2} {r['free_cores']:>4.2f} {r['bytes'] / 1e6:>8.2f} "
              f"{r['pred_bytes'] / 1e6:>8.2f} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['efficiency']:>5.2f} {r['collectives']:>4.0f} | "
              f"{r['pred_collectives']:>4.0f} {r['pred_step_s']:>7.3f} "
              f"{r['pred_tokens_per_s']:>10.0f} {r['pred_efficiency']:>8.2f} "
              f"{r['error_pct']:>+5.0f}%")
    ok = all(abs(r["error_pct"]) <= 20 for r in rows)
    print(f"\none-thread memory bandwidth (copy, read + write): "
          f"{out['host_copy_bytes_per_s'] / 1e9:.1f} GB/s; PowerSGD hook measured "
          f"{out.get('powersgd_hook_s', 0.0):.3f} s/step (the hook model at that bandwidth: "
          f"{out.get('hook_model_s', 0.0):.3f}); cores: {out['cores']}")
    print("collectives per step (coll) measured by the engine's counter and in the model; "
          "a 4 KB all-reduce over the link, measured: " + ", ".join(
              f"{1e3 * v:.2f} ms at {k} ranks" for k, v in out.get("collective_s", {}).items()))
    for n, c in out.get("link_counters", {}).items():
        print(f"link at world {n}: tbf sent {c['sent_bytes'] / 1e9:.2f} GB, dropped "
              f"{c['dropped']} packets; TCP retransmitted {c['retrans_segs']} segments, "
              f"{c['timeouts']} timeouts")
    print("link probe (one TCP stream, payload): "
          + ", ".join(f"{v:.0f} Mbit/s at tc rate {k}" for k, v in out["probe_mbit"].items()))
    by = {(r["mode"], r["world"]): r for r in rows}
    for m in ("adaptive", "fixed", "powersgd"):
        for n in (2, 4):
            if (m, n) in by and ("off", n) in by:
                print(f"{m} vs full rank at world {n}: "
                      f"{by[m, n]['tokens_per_s'] / by['off', n]['tokens_per_s']:.2f}x tokens/s, "
                      f"{by[m, n]['bytes'] / by['off', n]['bytes']:.3f}x bytes")
    rc = out.get("rate_check")
    if rc and ("off", 2) in by:
        slow = by["off", 2]["step_s"]
        responds = rc["step_s"] < 0.85 * slow
        ok = ok and responds
        print(f"{'PASS' if responds else 'FAIL'}  full rank at world 2: {slow:.3f} s/step at "
              f"{rate_mbit:g} Mbit/s, {rc['step_s']:.3f} s/step at {rc['rate_mbit']:g} Mbit/s "
              f"(the step follows the tc rate)")
    largest = max(abs(r["error_pct"]) for r in rows)
    if not verdict:
        print(f"(--quick: a smoke test, no verdict; largest error {largest:.0f}%)")
        return True
    print(f"{'PASS' if ok else 'FAIL'}  predicted tokens/s within 20% of measured "
          f"(largest error {largest:.0f}%)")
    return ok


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
