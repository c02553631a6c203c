"""Data-parallel scaling of full rank, low rank and PowerSGD: bytes per step from the model's
shape, the time of the gradient all-reduce over a link, and the scaling efficiency
(tokens/s at N ranks / (N x tokens/s at 1 rank), the per-rank batch held fixed) that follows.

Why a module of its own: the question "how far does sending fewer bytes carry data parallelism"
needs one formula applied to two very different links: GPUs behind NVLink and a NIC (the compute
side predicted by workbench.plan.terms), and the CPU ranks of benchmarks/lowrank_scaling.py behind
a `tc`-limited veth link (the compute side measured at world size 1 in the same run). The step is

    step(N) = compute(N) + exposed(allreduce(N)),   exposed = max(c (1 - overlap), c - backward)

with allreduce(N) a ring all-reduce: each rank sends and receives 2 (N-1)/N of the payload over
its share of the link, plus one latency per ring hop of every collective. The payload is what
the engine's ByteCounter measures (comm/allreduce_bytes): every trainable gradient once in fp32
for full and factorized models; for PowerSGD the rank-r factors P (m x r) and Q (n x r) of every
matrix it compresses and the uncompressed rest.

On CPU ranks, compute(N) is the one-rank step stretched by the sharing of cores: N ranks of one
thread on C cores free of other jobs take max(1, N / C) times as long (cpu_prediction), and
since the ranks wait for each other every step, each step lasts as long as the slowest rank's:
the median of the slowest of N one-rank steps (slowest_of, from the one-rank step times
measured in the same run). Every collective of the step (collectives(): DDP's buckets, or
PowerSGD's three all-reduces in its one bucket, and the loss) pays the latency of a small
all-reduce over the same link, measured in the same run. A collective's cost beyond that is
the wait for a peer that computes: on 2 shared cores a 4 KB all-reduce takes ~0.7 ms back to
back but ~4 ms after 20 ms of compute on each rank, on loopback as on the limited link
(benchmarks/lowrank_sync_probe.py wait), which is why PowerSGD, whose hook blocks per bucket,
runs in one bucket (parallelize.ddp_bucket_cap_mb). The
cores free of other jobs are measured with every step (benchmarks/lowrank_scaling.py): on a
machine shared with other jobs a neighbour costs one rank nothing and 4 ranks a fifth of their
share, which is what put full rank at 4 ranks 30% above this model in a run where they were
not counted (README, "Where bytes are the bottleneck").

PowerSGD also computes: its hook makes POWERSGD_PASSES passes over the gradient memory each step
(error feedback, copies, three thin matmuls), added to the step at every world size above one
at the memory bandwidth of the device (HBM on GPUs; on the CPU measured by the benchmark).
Left out, knowingly: the memory a 7B model's optimizer
state needs (the chart's question is the link, not the fit); gradient accumulation (it divides
the all-reduce's share of a step by the number of micro-batches, as more tokens per GPU do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.hardware import cluster_for
from workbench.plan.cost.shapes import ModelShape, model_shape

MODES = ("off", "lowrank", "powersgd")
# DDP's default bucket: gradients are all-reduced in buckets of 25 MB, one collective each
# (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
DDP_BUCKET_BYTES = 25 * 2**20
# ... except the first bucket (the last gradients of the backward), 1 MB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), kept after DDP rebuilds its buckets.
DDP_FIRST_BUCKET_BYTES = 2**20
# The engine all-reduces the step's mean loss too (one fp32), counted in comm/bytes_per_step.
LOSS_BYTES = 4
# Passes over the fp32 gradient memory torch's powerSGD_hook (torch 2.13, error feedback and warm
# start on) makes per step, counted in its source: add the error (read 2, write 1), keep a copy
# (2), stack same-shape matrices (2), P = M Q (1), Q = M^T P (1), M = P Q^T (1), copy back into
# the bucket (2), new error = copy - M (read 2, write 1): 15.
POWERSGD_PASSES = 15
# PyTorch's powerSGD_hook compresses a matrix only when r (m + n) * min_compression_rate <= m n
# (PowerSGDState default min_compression_rate=2); vectors are all-reduced uncompressed.
POWERSGD_MIN_COMPRESSION = 2.0
# TCP payload per byte `tc tbf` counts on an Ethernet veth at MTU 1500: 1448 payload bytes
# (1500 - 20 IP - 20 TCP - 12 timestamp option, RFC 791/9293/7323) per 1514-byte frame.
TCP_PAYLOAD_EFF = 1448 / 1514
# Per ring hop of one gloo collective over TCP between namespaces on one machine: a
# send/recv round through the kernel and gloo's pair (tens of microseconds per hop on veth).
# Only when not measured: benchmarks/lowrank_scaling.py measures a 4 KB all-reduce over its
# link (0.8-3 ms at 2 ranks, 8-17 ms at 4 ranks on 2 shared cores: a waiting rank must be
# scheduled at every hop) and cpu_prediction takes that instead.
GLOO_HOP_LATENCY_S = 100e-6
# Share of a step the backward pass takes when it is not measured: backward GEMMs (dX and dW)
# do twice the forward's FLOPs (Narayanan et al. 2021, the 6 = 2 + 4 FLOPs per parameter).
BACKWARD_SHARE = 2.0 / 3.0
# Fraction of the all-reduce gloo DDP hides behind the backward on CPU ranks of one intra-op
# thread each, every core busy with a rank: none. gloo's progress thread and the kernel's TCP
# work take their CPU time from the compute, and PowerSGD's hook waits for its all-reduces
# (lowrank/powersgd.py). Check: benchmarks/lowrank_scaling.py measures full rank at world
# size 2 over 1 Gbit/s within ~7% of the one-rank step plus the whole all-reduce.
GLOO_CPU_OVERLAP = 0.0


@dataclass(frozen=True)
class Link:
    """What one rank sees of the network a data-parallel group spans."""

    name: str
    bytes_per_s: float  # achieved bytes/s of one rank's share, each direction, across nodes
    hop_latency_s: float  # per ring hop of one collective
    overlap: float  # fraction of the all-reduce the stack can hide behind backward
    ranks_per_node: int = 1  # ranks that share a node (and its faster intra-node link)
    intra_bytes_per_s: float = 0.0  # achieved bytes/s inside a node (NVLink), 0: none
    ring_latency: bool = True  # latency per ring hop (gloo); False: per tree level (NCCL)


def gpu_link(name: str, nic_gbit_per_s: float, gpus_per_nic: int, gpu: str = "H100-SXM-80GB",
             co: Coefficients | None = None) -> Link:
    """GPUs of 8 per node on NVLink, and across nodes one NIC of nic_gbit_per_s per gpus_per_nic
    GPUs: a ring through a node's GPUs crosses to the next node on all its NICs, so across nodes
    each GPU gets the node's NIC bandwidth / 8 times the 8 GPUs' rails (the cost model's group_bw),
    never more than NVLink."""
    cl = cluster_for(gpu, 8)
    co = co or coefficients(cl)
    per_gpu = nic_gbit_per_s / 8 * 1e9 / gpus_per_nic * co.link_eff_inter
    intra = cl.intra_node_gbps * 1e9 * co.link_eff_intra
    return Link(name, min(per_gpu * cl.gpus_per_node, intra), co.coll_latency_inter_s,
                co.dp_overlap, cl.gpus_per_node, intra, ring_latency=False)


def cpu_link(rate_mbit: float, overlap: float, collective_s: float | None = None,
             n_ranks: int = 2) -> Link:
    """CPU ranks each behind its own `tc tbf`-limited veth NIC (workbench.testing.netns).
    `collective_s`: a small all-reduce's time over that link among n_ranks, measured
    (netns.small_allreduce_s); spread over the ring's 2 (n - 1) hops. None: GLOO_HOP_LATENCY_S."""
    hop = GLOO_HOP_LATENCY_S if collective_s is None or n_ranks < 2 \
        else collective_s / (2 * (n_ranks - 1))
    return Link(f"tc {rate_mbit:g} Mbit/s veth", rate_mbit * 1e6 / 8 * TCP_PAYLOAD_EFF,
                hop, overlap)


def _matrices(ms: ModelShape) -> list[tuple[int, int]]:
    """Every gradient matrix of the dense model: the blocks' linears, the token embedding (the
    tied head) and, for GPT-2, the learned position embedding."""
    mats = [(m, n) for _ in range(ms.n_layers) for m, n, _ in ms.dense]
    mats.append((ms.vocab, ms.hidden))
    if ms.embed_params > ms.vocab * ms.hidden:
        mats.append((ms.embed_params // ms.hidden - ms.vocab, ms.hidden))
    if ms.head_params:
        mats.append((ms.vocab, ms.hidden))
    return mats


def trainable_params(ms: ModelShape) -> float:
    """Parameters of the model as trained (factorized blocks at their low-rank shapes), with
    the final norm the block shapes leave out (LayerNorm weight + bias, or RMSNorm weight)."""
    final_norm = ms.hidden * (2 if not ms.gated_mlp and ms.other_layer_params > 2 * ms.hidden
                              else 1)
    return ms.n_layers * ms.mean_layer_params() + ms.embed_params + ms.head_params + final_norm


def dp_payload_bytes(ms: ModelShape, mode: str, powersgd_rank: int = 4,
                     grad_bytes: float = 4.0) -> float:
    """Bytes one rank all-reduces per step (after a low-rank switch / PowerSGD's start).
    `ms` is the shape of the model as trained (model_shape with the low-rank config)."""
    if mode != "powersgd":
        return trainable_params(ms) * grad_bytes + LOSS_BYTES
    r, sent, vectors = powersgd_rank, 0.0, trainable_params(ms)
    for m, n in _matrices(ms):
        vectors -= m * n
        compress = r * (m + n) * POWERSGD_MIN_COMPRESSION <= m * n
        sent += r * (m + n) if compress else m * n
    return (sent + vectors) * grad_bytes + LOSS_BYTES


def powersgd_hook_s(ms: ModelShape, mem_bytes_per_s: float, grad_bytes: float = 4.0) -> float:
    """Seconds PowerSGD's hook spends per step streaming the gradients (memory bound: its
    matmuls have r = 4 columns, a few FLOPs per byte)."""
    return POWERSGD_PASSES * trainable_params(ms) * grad_bytes / mem_bytes_per_s


def collectives(payload_bytes: float, mode: str) -> int:
    """All-reduces per step, as the engine issues them (counted: comm/collectives_per_step):
    one per DDP bucket (a first bucket of DDP_FIRST_BUCKET_BYTES, then DDP_BUCKET_BYTES each)
    and the step's loss; PowerSGD runs in one bucket (parallelize.ddp_bucket_cap_mb) and
    all-reduces three times in it: the uncompressed tensors, P, then Q."""
    if mode == "powersgd":
        return 3 + 1
    rest = max(0.0, payload_bytes - LOSS_BYTES - DDP_FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / DDP_BUCKET_BYTES) + 1


def slowest_of(samples: Sequence[float], n_ranks: int) -> float:
    """The median step of n_ranks that wait for each other once a step, from one rank's step
    times: every step lasts as long as the slowest rank's, and the median of the largest of n
    independent draws is the 0.5 ** (1 / n) quantile of one draw's distribution (0.71 for 2
    ranks, 0.84 for 4). Why: on shared cores one rank's step varies by several percent from
    step to step (other jobs, the scheduler), and n ranks pay the worst of n every step; the
    one-rank median does not show that. Empirical quantile, linear between order statistics."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("slowest_of needs at least one step time")
    pos = (len(xs) - 1) * 0.5 ** (1.0 / max(1, n_ranks))
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def allreduce_s(payload_bytes: float, n_ranks: int, link: Link, n_collectives: int = 1
                ) -> float:
    """Ring all-reduce of payload_bytes over n_ranks: bandwidth term + latency term."""
    if n_ranks <= 1:
        return 0.0
    inside = link.intra_bytes_per_s > 0 and n_ranks <= link.ranks_per_node
    bw = link.intra_bytes_per_s if inside else link.bytes_per_s
    # NCCL switches to trees (and hierarchical rings) at scale: ~1 + log2 N latency steps, as
    # the cost model's links.collective_link counts them; gloo's ring pays every hop.
    hops = 2 * (n_ranks - 1) if link.ring_latency else 1 + math.log2(n_ranks)
    return 2 * (n_ranks - 1) / n_ranks * payload_bytes / bw \
        + n_collectives * hops * link.hop_latency_s


@dataclass(frozen=True)
class DpPoint:
    """One predicted world size: seconds of a step, its all-reduce, and the efficiency."""

    n_ranks: int
    payload_bytes: float
    step_s: float
    compute_s: float
    allreduce_s: float
    exposed_s: float
    efficiency: float  # tokens/s at n / (n x tokens/s at 1)


def predict(step1_s: float, backward_s: float, payload_bytes: float, n_ranks: int, link: Link,
            n_collectives: int = 1, slowdown: float = 1.0, hook_s: float = 0.0) -> DpPoint:
    """The step at n_ranks given the step at one rank (no data-parallel traffic) and its
    backward; `slowdown`: compute at n ranks over compute at one (CPU cores shared by ranks);
    `hook_s`: compute the communication hook adds once there is more than one rank."""
    comp = (step1_s + (hook_s if n_ranks > 1 else 0.0)) * slowdown
    bwd = backward_s * slowdown
    c = allreduce_s(payload_bytes, n_ranks, link, n_collectives)
    exposed = max(c * (1 - link.overlap), c - bwd)
    step = comp + exposed
    return DpPoint(n_ranks, payload_bytes, step, comp, c, exposed, step1_s / step)


def cpu_prediction(model: ModelConfig, mode: str, step1_s: float, n_ranks: int,
                   rate_mbit: float, cores: float, hook_s: float = 0.0,
                   cores_at_1: float | None = None, step1_samples: Sequence[float] = (),
                   collective_s: float | None = None) -> DpPoint:
    """A mode of benchmarks/lowrank_scaling.py (off, adaptive, fixed, powersgd) on CPU ranks of
    one thread each behind the tc-limited link, from its measured one-rank step (and for
    PowerSGD its hook's measured compute, hook_s): the bytes from the shape (adaptive at
    rank_ratio: its ranks are chosen while training), ranks beyond the cores share them.

    `cores`: the cores the ranks had to themselves while the n-rank step was measured,
    `cores_at_1` (default: the same) while the one-rank step was: the machine's cores less
    the CPU other jobs took (benchmarks/lowrank_scaling.py measures both). On shared cores
    the n ranks compute max(1, n / cores) times as long as one rank with all it needs, and
    the measured one-rank step was itself stretched by max(1, 1 / cores_at_1).

    Measured in the same run when given: `step1_samples`, the one-rank step times (the n ranks
    wait for the slowest each step: slowest_of); `collective_s`, a small all-reduce over the
    link among n_ranks (the latency every collective of the step pays, collectives())."""
    kind = {"adaptive": "lowrank", "fixed": "lowrank"}.get(mode, mode)
    ms = model_shape(model, lowrank_config(kind))
    payload = dp_payload_bytes(ms, kind)
    hook = hook_s if kind == "powersgd" else 0.0
    at_1 = cores if cores_at_1 is None else cores_at_1
    slowdown = max(1.0, n_ranks / cores) / max(1.0, 1.0 / at_1)
    slowest = slowest_of(step1_samples, n_ranks) if step1_samples else step1_s
    point = predict(slowest, BACKWARD_SHARE * slowest, payload, n_ranks,
                    cpu_link(rate_mbit, GLOO_CPU_OVERLAP, collective_s, n_ranks),
                    collectives(payload, kind), slowdown, hook)
    return DpPoint(n_ranks, payload, point.step_s, point.compute_s, point.allreduce_s,
                   point.exposed_s, step1_s / point.step_s)


def lowrank_config(mode: str, rank_ratio: float = 0.25, powersgd_rank: int = 4
                   ) -> LowRankConfig:
    """The chart's three modes as low-rank configs ("lowrank": every block but the first and
    last factorized at rank_ratio, as fixed and adaptive train after their switch)."""
    if mode == "lowrank":
        return LowRankConfig(mode="fixed", rank_ratio=rank_ratio)
    if mode == "powersgd":
        return LowRankConfig(mode="powersgd", powersgd_rank=powersgd_rank)
    return LowRankConfig(mode="off")


def gpu_curve(model: ModelConfig, mode: str, link: Link, sizes: list[int],
              tokens_per_gpu: int = 8192, gpu: str = "H100-SXM-80GB") -> list[DpPoint]:
    """Predicted DP efficiency of `model` on GPUs: the one-GPU step (bf16, fused attention,
    micro-batch = tokens_per_gpu / seq_len) from the cost model's compute terms, the all-reduce
    from dp_payload_bytes over `link`. Memory is not checked (a 7B model needs its optimizer
    state sharded, which changes the collectives' kind, not the bytes)."""
    from workbench.plan.cost.estimate import estimate

    lr = lowrank_config(mode)
    cl: ClusterConfig = cluster_for(gpu, 1)
    mb = max(1, tokens_per_gpu // model.seq_len)
    train = TrainConfig(global_batch=mb, micro_batch=mb)
    est = estimate(model, cl, train, Layout(micro_batch=mb), lr)
    ms = model_shape(model, lr)
    payload = dp_payload_bytes(ms, "powersgd" if mode == "powersgd" else "dense",
                               lr.powersgd_rank)
    n_coll = collectives(payload, mode)
    hook = powersgd_hook_s(ms, cl.hbm_bw_bytes_per_s * coefficients(cl).hbm_eff) \
        if mode == "powersgd" else 0.0
    return [predict(est.step_time_s, est.time_s["time_bwd_s"], payload, n, link, n_coll,
                    hook_s=hook) for n in sizes]
