"""Data-parallel scaling of full rank, low rank and PowerSGD: bytes per step from the model's
shape, the time of the gradient all-reduce over a network, and the scaling efficiency
(tokens/s at N ranks / (N x tokens/s at 1 rank), the per-rank batch held fixed) that follows.

Why apart from the planner: the question "how far does sending fewer bytes carry data
parallelism" is the low-rank work's, and it is asked of two very different networks: GPUs behind
NVLink and NICs (the compute side predicted by the cost model's `estimate`), and the CPU ranks of
benchmarks/lowrank_scaling.py behind a `tc`-limited veth link (the compute side measured at
world size 1 in the same run). The all-reduce is the cost model's own
(workbench.plan.cost.communication: a ring all-reduce's 2 (N-1)/N of the payload over the
group's bandwidth plus the collective's latency, and what the backward hides of it); only the
network differs. On GPUs the cost model prices the group too (`collective_link`: NVLink inside
a node, the node's NICs across nodes, a latency per doubling of the group); the CPU ranks' veth
link is not a cluster the cost model knows, so its bandwidth is the `tc` rate's TCP payload and
its latency gloo's ring, one hop at a time (measured in the same run where given). The step is

    step(N) = compute(N) + exposed(allreduce(N)),   exposed = max(c (1 - overlap), c - backward)

The payload is what the engine's ByteCounter measures (comm/allreduce_bytes): every trainable
gradient once in fp32 for full and factorized models; for PowerSGD the rank-r factors P (m x r)
and Q (n x r) of every matrix it compresses and the uncompressed rest. Every collective of the
step (collectives(): DDP's buckets, or PowerSGD's three all-reduces in its one bucket, and the
loss) pays the latency.

On CPU ranks, compute(N) is the one-rank step stretched by the sharing of cores: N ranks of one
thread on C cores free of other jobs take max(1, N / C) times as long (cpu_prediction), and
since the ranks wait for each other every step, each step lasts as long as the slowest rank's:
the median of the slowest of N one-rank steps (slowest_of). A collective's cost beyond its
latency is the wait for a peer that computes, which is why PowerSGD, whose hook blocks per
bucket, runs in one bucket (parallelize.ddp_bucket_cap_mb); the README's "Where bytes are the
bottleneck" has the measurements behind these choices.

PowerSGD also computes: its hook makes POWERSGD_PASSES passes over the gradient memory each step
(error feedback, copies, three thin matmuls), added to the step at every world size above one at
the memory bandwidth of the device (HBM on GPUs; on the CPU measured by the benchmark). Left
out, knowingly: the memory a 7B model's optimizer state needs (the chart's question is the link,
not the fit); gradient accumulation (it divides the all-reduce's share of a step by the number
of micro-batches, as more tokens per GPU do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from workbench.config import ClusterConfig, LowRankConfig, ModelConfig, TrainConfig
from workbench.layout import Layout
from workbench.plan.cost.coefficients import Coefficients, coefficients
from workbench.plan.cost.communication import allreduce_s, collective_link, exposed_s
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.hardware import GpuSpec, cluster_for, hardware_for
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
# Only when not measured: benchmarks/lowrank_scaling.py measures a small all-reduce over its
# link (a waiting rank must be scheduled at every hop) and cpu_prediction takes that instead.
GLOO_HOP_LATENCY_S = 100e-6
# Share of a step the backward pass takes when it is not measured: backward GEMMs (dX and dW)
# do twice the forward's FLOPs (Narayanan et al. 2021, the 6 = 2 + 4 FLOPs per parameter).
BACKWARD_SHARE = 2.0 / 3.0
# Fraction of the all-reduce gloo DDP hides behind the backward on CPU ranks of one intra-op
# thread each, every core busy with a rank: none. gloo's progress thread and the kernel's TCP
# work take their CPU time from the compute, and PowerSGD's hook waits for its all-reduces
# (lowrank/powersgd.py). Check: benchmarks/lowrank_scaling.py measures full rank at world
# size 2 over 1 Gbit/s close to the one-rank step plus the whole all-reduce.
GLOO_CPU_OVERLAP = 0.0


@dataclass(frozen=True)
class DpNetwork:
    """The network a data-parallel group spans, as its all-reduce sees it. GPUs: the cost
    model's own links (`gpu` and `coeff` given). CPU ranks: each behind its own rate-limited
    link of `bytes_per_s`, gloo paying `hop_latency_s` per ring hop of every collective."""

    name: str
    overlap: float  # fraction of the all-reduce the stack can hide behind backward
    gpu: GpuSpec | None = None
    coeff: Coefficients | None = None
    bytes_per_s: float = 0.0  # CPU ranks: achieved bytes/s of one rank's link, each direction
    hop_latency_s: float = 0.0  # CPU ranks: per ring hop of one collective

    def path(self, n_ranks: int) -> tuple[float, float]:
        """(bytes/s each rank gets, latency s of one collective) over a group of n_ranks."""
        if self.gpu is not None and self.coeff is not None:
            bw, latency = collective_link(np.float64(n_ranks), 1.0, self.gpu, self.coeff)
            return float(bw), float(latency)
        return self.bytes_per_s, 2 * (n_ranks - 1) * self.hop_latency_s


def gpu_network(name: str, nic_gbit_per_s: float, gpus_per_nic: int,
                gpu: str = "H100-SXM-80GB", coeff: Coefficients | None = None) -> DpNetwork:
    """Nodes of 8 GPUs of `gpu` on NVLink, and across nodes one NIC of nic_gbit_per_s per
    gpus_per_nic GPUs: the cluster the cost model then prices the group on (a ring through a
    node's GPUs crosses to the next node on all its NICs, never faster than NVLink)."""
    cluster = replace(cluster_for(gpu, 8), inter_node_gbps=nic_gbit_per_s / 8 / gpus_per_nic)
    co = coeff or coefficients(cluster)
    return DpNetwork(name, co.dp_overlap, gpu=hardware_for(cluster), coeff=co)


def cpu_network(rate_mbit: float, overlap: float, collective_s: float | None = None,
                n_ranks: int = 2) -> DpNetwork:
    """CPU ranks each behind its own `tc tbf`-limited veth NIC (workbench.testing.netns).
    `collective_s`: a small all-reduce's time over that link among n_ranks, measured
    (netns.small_allreduce_s); spread over the ring's 2 (n - 1) hops. None: GLOO_HOP_LATENCY_S."""
    hop = GLOO_HOP_LATENCY_S if collective_s is None or n_ranks < 2 \
        else collective_s / (2 * (n_ranks - 1))
    return DpNetwork(f"tc {rate_mbit:g} Mbit/s veth", overlap,
                     bytes_per_s=rate_mbit * 1e6 / 8 * TCP_PAYLOAD_EFF, hop_latency_s=hop)


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


def predict(step1_s: float, backward_s: float, payload_bytes: float, n_ranks: int,
            network: DpNetwork, n_collectives: int = 1, slowdown: float = 1.0,
            hook_s: float = 0.0) -> DpPoint:
    """The step at n_ranks given the step at one rank (no data-parallel traffic) and its
    backward; `slowdown`: compute at n ranks over compute at one (CPU cores shared by ranks);
    `hook_s`: compute the communication hook adds once there is more than one rank. The
    payload is all-reduced by the cost model's ring all-reduce over `network`, every one of the
    step's `n_collectives` collectives paying its latency."""
    comp = (step1_s + (hook_s if n_ranks > 1 else 0.0)) * slowdown
    bwd = backward_s * slowdown
    bw, latency = network.path(n_ranks)
    total = float(allreduce_s(n_ranks, payload_bytes, 1.0, bw, n_collectives * latency))
    exposed = float(exposed_s(total, bwd, network.overlap))
    step = comp + exposed
    return DpPoint(n_ranks, payload_bytes, step, comp, total, exposed, step1_s / step)


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
                    cpu_network(rate_mbit, GLOO_CPU_OVERLAP, collective_s, n_ranks),
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


def gpu_curve(model: ModelConfig, mode: str, network: DpNetwork, sizes: list[int],
              tokens_per_gpu: int = 8192, gpu: str = "H100-SXM-80GB") -> list[DpPoint]:
    """Predicted DP efficiency of `model` on GPUs: the one-GPU step (bf16, fused attention,
    micro-batch = tokens_per_gpu / seq_len) from the cost model's compute terms, the all-reduce
    of dp_payload_bytes over `network`. Memory is not checked (a 7B model needs its optimizer
    state sharded, which changes the collectives' kind, not the bytes)."""
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
    return [predict(est.step_time_s, est.time_s["time_bwd_s"], payload, n, network, n_coll,
                    hook_s=hook) for n in sizes]
