"""Where the time of a data-parallel step over the tc-limited link goes, part by part: the
all-reduce alone (no compute) and the compute alone (no all-reduce), at 1, 2 and 4 ranks on
this machine's cores, with the CPU time the whole machine spends meanwhile.

    sudo python benchmarks/lowrank_scaling_probe.py comm [--worlds 2,4] [--rate-mbit 1000]
    python benchmarks/lowrank_scaling_probe.py compute [--worlds 1,2,4]

Why: benchmarks/lowrank_scaling.py measures whole steps, and the cost model predicts them as
compute (the one-rank step, stretched when ranks outnumber cores) plus an exposed ring
all-reduce. When a measured point misses the prediction, these two probes say which part
was wrong.

- comm: every rank in its own network namespace behind the limited veth NIC
  (workbench.testing.netns), gloo all-reduces of gpt_small's gradient payload in DDP's buckets
  (1 MB first, then 25 MB), issued asynchronously as DDP does, with nothing else to compute.
  Printed: seconds per all-reduce of the payload vs the ring's 2 (N-1)/N x payload / rate,
  and the CPU-seconds the machine spent per all-reduce (from /proc/stat: user, system and
  softirq of all cores), i.e. what gloo and the kernel's veth/bridge/tbf path take.
- compute: N processes (no process group), each training gpt_small steps at 2 sequences of
  128 tokens on one thread, in lockstep (a barrier after every step, as DDP's all-reduce
  makes them); the median step vs one alone is the compute slowdown of N ranks on these
  cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch.multiprocessing as mp

PAYLOAD_BYTES = 57375744  # gpt_small's fp32 gradients at seq_len 128 (14,343,936 parameters)
FIRST_BUCKET_BYTES = 1 << 20  # DDP: dist._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20  # DDP: bucket_cap_mb=25
MODEL = ["model=gpt_small", "model.seq_len=128", "tracking=none", "train.micro_batch=2",
         "train.global_batch=2"]


def buckets(payload_bytes: int) -> List[int]:
    """Element counts of DDP's buckets for a payload: 1 MB, then 25 MB each, then the rest."""
    sizes, left = [], payload_bytes
    for cap in [FIRST_BUCKET_BYTES] + [BUCKET_BYTES] * (payload_bytes // BUCKET_BYTES + 1):
        if left <= 0:
            break
        sizes.append(min(cap, left) // 4)
        left -= cap
    return sizes


def cpu_jiffies() -> Dict[str, int]:
    """Machine-wide CPU time from /proc/stat (USER_HZ ticks): busy parts and idle."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return {"user": v[0] + v[1], "system": v[2], "softirq": v[5] + v[4], "idle": v[3] + v[4]}


def _comm_child(rank: int, n: int, store: str, ns: List[str], steps: int, q) -> None:
    import torch
    import torch.distributed as dist

    from workbench.testing.netns import IFNAME, enter_namespace

    enter_namespace(ns[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n)
    tensors = [torch.ones(k) for k in buckets(PAYLOAD_BYTES)]
    times, ticks = [], []
    for i in range(steps + 2):  # two to warm up TCP windows and gloo's buffers
        dist.barrier()
        j0, t0 = cpu_jiffies(), time.perf_counter()
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        t1, j1 = time.perf_counter(), cpu_jiffies()
        if i >= 2:
            times.append(t1 - t0)
            ticks.append({k: j1[k] - j0[k] for k in j0})
    dist.destroy_process_group()
    if rank == 0:
        q.put({"times": times, "ticks": ticks})


def hogs(k: int) -> List[Any]:
    """k processes that only spin: another job busy on k cores, made on purpose, so that the
    effect of other load on a step is measured, not waited for."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def comm(worlds: List[int], rate_mbit: float, steps: int, n_hogs: int = 0) -> None:
    from workbench.lowrank.dp_scaling import TCP_PAYLOAD_EFF

    hz = os.sysconf("SC_CLK_TCK")
    bw = rate_mbit * 1e6 / 8 * TCP_PAYLOAD_EFF
    print(f"all-reduce of {PAYLOAD_BYTES / 1e6:.1f} MB in DDP buckets {buckets(PAYLOAD_BYTES)} "
          f"(fp32 elements), {rate_mbit:g} Mbit/s tc tbf per NIC, nothing else computing"
          + (f" but {n_hogs} spinning process(es)" if n_hogs else ""))
    spinning = hogs(n_hogs)
    try:
        for n in worlds:
            _comm_one(n, rate_mbit, steps, bw, hz)
    finally:
        for p in spinning:
            p.kill()
            p.wait()


def _comm_one(n: int, rate_mbit: float, steps: int, bw: float, hz: int) -> None:
    from workbench.testing.netns import LimitedLink

    with LimitedLink(n, rate_mbit) as link:
        q = mp.get_context("spawn").SimpleQueue()
        store = tempfile.mktemp(prefix="wb-probe-")
        ctx = mp.spawn(_comm_child, args=(n, store, link.namespaces, steps, q), nprocs=n,
                       join=False)
        while not ctx.join(timeout=2):
            pass
        r = q.get()
        tcp = link.counters()
    med = statistics.median(r["times"])
    ring = 2 * (n - 1) / n * PAYLOAD_BYTES / bw
    per = {k: sum(t[k] for t in r["ticks"]) / len(r["ticks"]) / hz for k in r["ticks"][0]}
    busy = per["user"] + per["system"] + per["softirq"]
    print(f"N={n}: {med:.3f} s per all-reduce (min {min(r['times']):.3f}, max "
          f"{max(r['times']):.3f}); ring model {ring:.3f} s ({100 * (med / ring - 1):+.0f}%); "
          f"machine CPU per all-reduce: {busy:.2f} core-s (user {per['user']:.2f}, system "
          f"{per['system']:.2f}, softirq {per['softirq']:.2f}), idle {per['idle']:.2f}; "
          f"tbf dropped {tcp['dropped']} packets, TCP retransmitted {tcp['retrans_segs']} "
          f"segments, {tcp['timeouts']} timeouts", flush=True)


def _compute_child(rank: int, n: int, steps: int, barrier, q) -> None:
    import torch

    from workbench.compose import compose
    from workbench.train.model import build, cross_entropy

    torch.set_num_threads(1)
    cfg = compose(MODEL)
    model = build(cfg.model, cfg.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.model.vocab, (2, cfg.model.seq_len + 1))
    times = []
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(steps):
        cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        barrier.wait()  # the ranks of a data-parallel step wait for the slowest, as DDP's do
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    if rank == 0:
        q.put(times)


def compute(worlds: List[int], steps: int) -> None:
    base = None
    for n in worlds:
        mctx = mp.get_context("spawn")
        barrier, q = mctx.Barrier(n), mctx.SimpleQueue()
        procs = [mctx.Process(target=_compute_child, args=(r, n, steps, barrier, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        times = q.get()
        for p in procs:
            p.join()
        step = statistics.median(times[2:])
        base = base or step
        print(f"N={n} processes in lockstep (a barrier per step), 1 thread each, on "
              f"{os.cpu_count()} cores: median step {step:.3f} s (min {min(times[2:]):.3f}), "
              f"{step / base:.2f}x the first world size's", flush=True)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["comm", "compute"])
    ap.add_argument("--worlds", default="")
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hogs", type=int, default=0,
                    help="comm: processes spinning meanwhile (other jobs, made on purpose)")
    a = ap.parse_args(argv)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if a.what == "comm":
        from workbench.testing.netns import unavailable_reason

        why = unavailable_reason()
        if why:
            print(f"lowrank_scaling_probe: the rate-limited link {why}", file=sys.stderr)
            return 2
        comm([int(w) for w in (a.worlds or "2,4").split(",")], a.rate_mbit, a.steps, a.hogs)
    else:
        compute([int(w) for w in (a.worlds or "1,2,4").split(",")], a.steps)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
