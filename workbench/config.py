"""Typed schemas for every config group, registered with Hydra's ConfigStore.

The YAML files under conf/ hold values only; these dataclasses are the schema they are merged
onto, so an unknown key or a wrong type fails at composition time instead of deep in training.
`workbench.config_rules.validate()` adds the rules a type cannot express (heads divide hidden,
ranges, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from workbench.config_profile import ClusterProfile

CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "llama"  # llama: RMSNorm+RoPE+SwiGLU+GQA; gpt2: LayerNorm+learned pos+GELU
    n_layers: int = MISSING
    hidden: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    ffn_hidden: int = MISSING
    vocab: int = MISSING
    seq_len: int = MISSING
    tie_embeddings: bool = False
    bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    published_params: int = 0  # the count the model's paper or card gives; 0 = none published


@dataclass
class PoolConfig:
    """One pool of a mixed cluster: nodes of one GPU type on one fabric
    (workbench.plan.pools.cluster). The figures left at 0 come from the datasheet of `gpu`
    (workbench.plan.cost.hardware.match_gpu)."""

    name: str = MISSING
    gpu: str = MISSING  # accelerator name, matched loosely (A100 80GB, V100, T4, H100 ...)
    nodes: int = 1
    gpus_per_node: int = 0  # 0: the GPU's usual node
    peak_bf16_flops: float = 0.0  # dense 16-bit tensor-core FLOP/s per device
    peak_fp32_flops: float = 0.0
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s; 0 for a GPU no datasheet matches: no FP8
    hbm_bytes: float = 0.0
    hbm_bw_bytes_per_s: float = 0.0
    intra_node_gbps: float = 0.0  # per device, one direction, GB/s (NVLink / PCIe)
    inter_node_gbps: float = 0.0  # per device, one direction, GB/s (its NIC share)
    sm_count: int = 0  # streaming multiprocessors (GEMM wave quantization); 0: unknown
    # The Slurm partition of this pool's nodes: launcher=slurm with launcher.stage_pools runs
    # one heterogeneous-job component per pool in it (workbench/launch/hetjob.py).
    partition: str = ""


@dataclass
class PoolLinkConfig:
    """The network between two pools: what a pipeline cut between them pays."""

    pools: List[str] = field(default_factory=list)  # the two pool names
    gbps: float = MISSING  # per device, one direction, GB/s across the cut
    latency_s: float = 20e-6


@dataclass
class ClusterConfig:
    name: str = MISSING
    gpu: str = "cpu"  # accelerator name, matched loosely by the planner
    device: str = "cpu"  # torch device type the ranks use: cpu | cuda
    nodes: int = 1
    gpus_per_node: int = 1
    peak_bf16_flops: float = MISSING  # dense, per device
    peak_fp32_flops: float = MISSING
    hbm_bytes: float = MISSING  # memory per device
    hbm_bw_bytes_per_s: float = MISSING
    intra_node_gbps: float = MISSING  # per device, one direction, GB/s (NVLink)
    inter_node_gbps: float = MISSING  # per device, one direction, GB/s (NIC share)
    # 0: the datasheet's figure of the GPU `gpu` names (none where it names no known GPU)
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s per device
    sm_count: int = 0  # streaming multiprocessors (GEMM wave quantization)
    # Calibrated cost-model coefficients by name (see workbench/plan/cost/coefficients.py);
    # empty means the physical defaults.
    coeff: Dict[str, float] = field(default_factory=dict)
    # A mixed cluster: its pools and the links between them (empty: one pool, the fields above).
    pools: List[PoolConfig] = field(default_factory=list)
    links: List[PoolLinkConfig] = field(default_factory=list)
    # Measured curves of this cluster; None: the datasheet figures above and coefficients.
    profile: Optional[ClusterProfile] = None


@dataclass
class LayoutConfig:
    """Parallel degrees as asked for; -1 on at most one degree means "the rest of the world"."""

    name: str = "single"
    auto: bool = False  # ask the planner for the best feasible layout
    mem_margin_gib: float = 0.0  # GiB a layout must be predicted to leave free (auto: to pick)
    # A new run whose layout the cost model predicts does not fit in cluster.hbm_bytes (plus
    # the margin) is refused before anything is recorded; false runs it anyway.
    check_memory: bool = True
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | selective_op | full
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    virtual_stages: int = 1
    # Layers of each global pipeline stage (pp * virtual_stages entries, summing to
    # model.n_layers; first and last may be 0, e.g. [3,5,5,3]); empty = the even split.
    stage_layers: List[int] = field(default_factory=list)


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 1337
    global_batch: int = 16  # sequences per optimizer step
    # Sequences per forward/backward on one data-parallel rank; 0 = the largest the global batch
    # allows without accumulation (layout.auto_micro_batch), resolved before the job is written.
    micro_batch: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    lr_schedule: str = "cosine"  # cosine | wsd (warm-up, stable, decay) | constant
    decay_steps: int = 0  # wsd: the last steps, decaying 1-sqrt to the floor; 0 = 20% of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 50
    # Validation size in global batches (eval_batches x global_batch sequences, the same ones at
    # every evaluation and in every layout, so val_loss compares across layouts).
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_ckpts: int = 2  # the newest checkpoints kept ...
    keep_every: int = 0  # ... and every checkpoint at a multiple of this step, for good (0: none)
    log_every: int = 1
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | fp32 | bf16
    compile: bool = False
    run_dir: str = ""  # empty: runs/<timestamp>-<id>; an existing run dir resumes it
    # Start from another run's checkpoint (workbench.train.branch): its run folder (the newest
    # whole checkpoint) or one checkpoint; recorded resolved to that checkpoint.
    init_from: str = ""
    init_state: str = "all"  # all: weights, optimizer and step (continue) | weights: weights only
    threads: int = 0  # torch intra-op threads; 0 = torch's default


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | tokens (presets: stdlib, stdlib_bpe, tokens)
    path: str = ""  # tokens: folder made by python -m workbench.data.prepare
    cache_dir: str = ""  # empty: $WORKBENCH_CACHE or ~/.cache/workbench
    max_bytes: int = 8_000_000  # stdlib: bytes of source text to use (per part for sources)
    val_frac: float = 0.05
    # Which windows a step reads (workbench.data.order): random (uniform starts, with
    # replacement) | epochs (each non-overlapping window once per epoch, seeded order).
    order: str = "random"
    # The embedded corpus' tokenizer: bytes (vocab 256) | bpe:N (a byte-level BPE trained on it
    # at first use, cached) | a tokenizer.json. Shards from prepare carry their own.
    tokenizer: str = "bytes"
    # A mixture: source name -> a prepared folder or stdlib:tests|modules|docs|all. Each step's
    # sequences are drawn by `weights` (missing: equal); validation loss is logged per source
    # and for `target` (missing: the training weights) as val_loss.
    sources: Dict[str, str] = field(default_factory=dict)
    weights: Dict[str, float] = field(default_factory=dict)
    target: Dict[str, float] = field(default_factory=dict)


@dataclass
class LowRankConfig:
    mode: str = "off"  # off | adaptive | fixed | powersgd
    check_every: int = 10
    power_iters: int = 2
    rank_lower_bound: float = 0.05
    # adaptive: grow every rank by one common factor while the bytes per step stay at least
    # this share below full rank's (0: the stable-rank ranks as they are; ranks never shrink)
    target_reduction: float = 0.0
    round_to: int = 1
    keep_first_blocks: int = 1
    keep_last_blocks: int = 1
    # adaptive: the switch criterion, in units of training progress (detector.py)
    signal: str = "rank"  # rank | stable_rank | energy_rank | subspace (signals.py)
    threshold: float = 1.0  # settled below this |change| per 1% of training, % of full rank
    smooth_pct: float = 5.0  # EMA time constant of the rate, % of training
    window_pct: float = 5.0  # a layer latches after this long below threshold, % of training
    straggler_frac: float = 0.1  # when at most this share of layers (>= 1) is still open ...
    straggler_relax: float = 2.0  # ... their threshold is multiplied by this
    energy: float = 0.9  # energy_rank: share of ||W - W0||_F^2 the directions hold
    min_switch_frac: float = 0.05
    max_switch_frac: float = 0.5
    switch_frac: float = 0.1  # fixed: switch at this fraction of training
    rank_ratio: float = 0.25  # fixed: rank as a fraction of min(m, n)
    lr_rescale: float = 1.0
    rewarm_steps: int = 10
    keep_dense_state: bool = True  # adaptive/fixed: layers left dense keep their AdamW state
    frobenius_decay: float = 1e-4
    powersgd_rank: int = 4
    powersgd_start_iter: int = 10
    # PowerSGD on CPU ranks: DDP in one gradient bucket (False: DDP's 25 MB buckets, as on GPUs;
    # parallelize.ddp_bucket_cap_mb says why)
    powersgd_one_bucket: bool = True


@dataclass
class LauncherConfig:
    name: str = "local"  # local | torchrun | slurm
    nproc_per_node: int = 1
    nodes: int = 1
    tasks_per_node: int = 1
    partition: str = ""
    time_min: int = 60
    account: str = ""
    qos: str = ""
    constraint: str = ""
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    extra_sbatch: Dict[str, str] = field(default_factory=dict)
    # Slurm over a cluster's pools: the pool (cluster.pools[*].name) of each pipeline rank, pp
    # entries. Non-empty: ONE heterogeneous job, a component per pool in its partition, each
    # stage's ranks on its pool (workbench/launch/hetjob.py). Empty: one ordinary job.
    stage_pools: List[str] = field(default_factory=list)


@dataclass
class TrackingConfig:
    backend: str = "mlflow"  # mlflow | none
    uri: str = ""  # empty: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working folder
    experiment: str = "workbench"

    def resolved_uri(self) -> str:
        """The URI the run writes to: explicit, then the environment, then a local sqlite."""
        from workbench.places import tracking_uri

        return tracking_uri(self.uri)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sweep: Optional[Dict[str, Any]] = None  # filled by +sweep=NAME; schema in workbench/sweep


CHOICES: Dict[str, List[str]] = {
    "model.family": ["llama", "gpt2"],
    "cluster.device": ["cpu", "cuda"],
    "layout.recompute": ["none", "selective", "selective_op", "full"],
    "layout.pp_schedule": ["gpipe", "1f1b", "interleaved_1f1b"],
    "train.dtype": ["auto", "fp32", "bf16"],
    "train.lr_schedule": ["cosine", "wsd", "constant"],
    "train.init_state": ["all", "weights"],
    "data.name": ["stdlib", "tokens"],
    "data.order": ["random", "epochs"],
    "lowrank.mode": ["off", "adaptive", "fixed", "powersgd"],
    "lowrank.signal": ["rank", "stable_rank", "energy_rank", "subspace"],
    "launcher.name": ["local", "torchrun", "slurm"],
    "tracking.backend": ["mlflow", "none"],
}


def compute_dtype(train: TrainConfig, cluster: ClusterConfig) -> str:
    """The dtype matmuls run in: `auto` means bf16 on GPUs (what a real run uses) and fp32 on
    the CPU (where bf16 is slow and the dry run must match single-process losses)."""
    if train.dtype != "auto":
        return train.dtype
    return "bf16" if cluster.device == "cuda" else "fp32"


def register() -> None:
    """Make the schema the base of the primary config, so every group YAML is type-checked."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
