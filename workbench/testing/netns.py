"""A rate-limited network between ranks on one machine: one network namespace per rank, each
with one veth NIC plugged into a bridge in a hub namespace, every NIC shaped by `tc tbf` in both
directions.

Why: on loopback, gloo moves gigabytes per second and communication is never the bottleneck on a
CPU; to measure what sending fewer bytes buys where bytes are the bottleneck, the ranks must talk
over a link of known, limited bandwidth. A star of per-rank NICs limited in both directions is a
switch with one port per GPU: each rank sends and receives at most the rate, as a GPU behind its
own NIC does. Only private addresses on this machine are used (10.77.0.0/24, no route out).

Needs root (CAP_NET_ADMIN) and iproute2. Namespace names carry this process's id, so two runs
never collide, and namespaces left by a process that was killed with SIGKILL are removed by the
next run (`remove_stale`).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
from types import TracebackType
from typing import List, Optional, Type

PREFIX = "wbnet"
IFNAME = "wb0"  # the rank's NIC, the same name in every rank namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000


class LinkUnavailable(RuntimeError):
    """Namespaces or tc cannot be used here (not root, no iproute2); the message says which."""


def unavailable_reason() -> str:
    """Why a limited link cannot be built here, or '' when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` on PATH"
    return ""


def _sh(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")


def _namespaces() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def remove_stale() -> None:
    """Delete namespaces of earlier runs whose process no longer exists."""
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX):].split("x")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


class LimitedLink:
    """`with LimitedLink(n, rate_mbit) as link:` rank i joins `link.namespaces[i]` (enter it with
    `enter_namespace` before creating any socket or thread) and reaches the others at
    `address(j)` through `IFNAME`. The namespaces are deleted on exit, on SIGTERM and SIGINT."""

    def __init__(self, n_ranks: int, rate_mbit: float, burst_kb: int = 256):
        self.n, self.rate_mbit, self.burst_kb = int(n_ranks), float(rate_mbit), int(burst_kb)
        tag = f"{PREFIX}{os.getpid()}x{id(self) % 10000}"
        self.hub = f"{tag}h"
        self.namespaces = [f"{tag}r{i}" for i in range(self.n)]
        self._old_handlers: dict = {}

    def _shape(self, ns: str, dev: str) -> None:
        # tbf: a token bucket at the rate; 50 ms of queue before drops, as the recipe
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            f"{self.rate_mbit:g}mbit", "burst", f"{self.burst_kb}kb", "latency", "50ms")

    def set_rate(self, rate_mbit: float) -> None:
        """Change the rate of every NIC in place (both directions)."""
        self.rate_mbit = float(rate_mbit)
        for i, ns in enumerate(self.namespaces):
            for n, dev in ((ns, IFNAME), (self.hub, f"h{i}")):
                _sh("tc", "-n", n, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    f"{self.rate_mbit:g}mbit", "burst", f"{self.burst_kb}kb", "latency", "50ms")

    def counters(self) -> dict:
        """Totals over every NIC and rank since the link came up: what tbf sent, dropped
        (its queue full) and held back (overlimits: the sender had to wait for tokens), and
        the ranks' TCP retransmitted segments and retransmission timeouts (nstat). A drop or
        a timeout stalls a ring all-reduce for a round trip or 200 ms; none means the link
        ran at its rate whenever it had bytes."""
        out = {"sent_bytes": 0, "dropped": 0, "overlimits": 0, "retrans_segs": 0,
               "timeouts": 0}
        for i, ns in enumerate(self.namespaces):
            for n, dev in ((ns, IFNAME), (self.hub, f"h{i}")):
                text = subprocess.run(["tc", "-s", "-n", n, "qdisc", "show", "dev", dev],
                                      capture_output=True, text=True, check=False).stdout
                m = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)",
                              text)
                if m:
                    for key, v in zip(("sent_bytes", "dropped", "overlimits"), m.groups()):
                        out[key] += int(v)
            text = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az", "TcpRetransSegs",
                                   "TcpExtTCPTimeouts"], capture_output=True, text=True,
                                  check=False).stdout
            for key, name in (("retrans_segs", "TcpRetransSegs"),
                              ("timeouts", "TcpExtTCPTimeouts")):
                m = re.search(rf"^{name}\s+(\d+)", text, re.M)
                out[key] += int(m.group(1)) if m else 0
        return out

    def up(self) -> LimitedLink:
        reason = unavailable_reason()
        if reason:
            raise LinkUnavailable(reason)
        remove_stale()
        _sh("ip", "netns", "add", self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer", "name",
                IFNAME, "netns", ns)
            _sh("ip", "-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            _sh("ip", "-n", self.hub, "link", "set", f"h{i}", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, IFNAME)  # what the rank sends
            self._shape(self.hub, f"h{i}")  # what the rank receives
        return self

    def down(self) -> None:
        for ns in [*self.namespaces, self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def __enter__(self) -> LimitedLink:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.down()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def enter_namespace(name: str) -> None:
    """Move the calling process (its current thread; call it before any other thread exists)
    into network namespace `name`: sockets it opens afterwards live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29411)); s.listen(1); print('ready', flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b'k'); c.close()
"""
_CLIENT = """
import socket, sys, time
n = int(sys.argv[2]); buf = b'x' * (1 << 20)
c = socket.create_connection((sys.argv[1], 29411)); t0 = time.perf_counter(); sent = 0
while sent < n:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(sent / (time.perf_counter() - t0), flush=True)
"""


def probe_bytes_per_s(link: LimitedLink, nbytes: int = 32 << 20) -> float:
    """TCP payload bytes/s from rank 1 to rank 0 over the link (one stream), measured with
    plain sockets: what a collective can get at most, to check the shaping took effect."""
    import sys

    server = subprocess.Popen(["ip", "netns", "exec", link.namespaces[0], sys.executable, "-c",
                               _SERVER, address(0)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        out = subprocess.run(["ip", "netns", "exec", link.namespaces[1], sys.executable, "-c",
                              _CLIENT, address(0), str(nbytes)], capture_output=True,
                             text=True, check=True, timeout=120)
        return float(out.stdout.strip())
    finally:
        server.kill()
        server.wait()


def timed_allreduce_child(rank: int, n: int, store: str, namespaces: Optional[List[str]],
                          nbytes: int, iters: int, out: str, busy_ms: float = 0.0) -> None:
    """One rank of a timed blocking gloo all-reduce loop (rank 0 writes the seconds of each to
    `out`): in the link's namespaces, or on loopback when `namespaces` is None; `busy_ms` of
    matrix products before each one lets the ranks drift apart as a training step's compute
    does (benchmarks/lowrank_sync_probe.py)."""
    import json
    import time

    import torch
    import torch.distributed as dist

    if namespaces:
        enter_namespace(namespaces[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME if namespaces else "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n)
    t, a = torch.ones(max(1, nbytes // 4)), torch.randn(256, 256)
    times = []
    for _ in range(iters + 5):  # five to open gloo's connections and warm TCP
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_ms / 1e3:
            a @ a
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times[5:], f)


def small_allreduce_s(link: LimitedLink, nbytes: int = 4096, iters: int = 60) -> float:
    """Median seconds of one blocking gloo all-reduce of `nbytes` among all of the link's ranks,
    one after another with nothing computing: the latency every collective of a step pays
    whatever its size (gloo's ring: 2 (N - 1) sends and receives through the kernel, the
    veth pair, the bridge and tbf, and a wake-up of the waiting thread for each)."""
    import json
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    store = tempfile.mktemp(prefix="wb-small-")
    out = tempfile.mktemp(prefix="wb-small-", suffix=".json")
    mp.spawn(timed_allreduce_child, args=(link.n, store, link.namespaces, nbytes, iters, out),
             nprocs=link.n, join=True)
    with open(out) as f:
        times = json.load(f)
    os.unlink(out)
    return statistics.median(times)


def _job_rank(rank: int, namespaces: List[str], port: int, job_path: str) -> None:
    """One rank of a job in its namespace: the env:// rendezvous a launcher would set, on the
    first rank's address over the link, then the job kind's own rank code."""
    enter_namespace(namespaces[rank])
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(len(namespaces)),
                       "LOCAL_RANK": "0", "MASTER_ADDR": address(0), "MASTER_PORT": str(port),
                       "GLOO_SOCKET_IFNAME": IFNAME})
    from workbench.job import Job

    Job.load(job_path).run_on_this_rank(progress=rank == 0)


def run_job_in_namespaces(link: LimitedLink, job_path: str, port: int = 29431) -> None:
    """Run a job file's ranks one per namespace of `link` (each rank a node of its own, as
    over a network), as a launcher would: what a profile of the link needs."""
    import torch.multiprocessing as mp

    mp.spawn(_job_rank, args=(link.namespaces, port, job_path), nprocs=link.n, join=True)
