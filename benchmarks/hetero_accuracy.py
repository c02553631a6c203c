"""Score the pool planner's cost model on AMP's published sweeps beside AMP's own cost model.

AMP (Li et al., NeurIPS 2022) ran GPT-2 (24 layers, hidden 1024, seq 1024, global batch 32,
fp16 Megatron-DeepSpeed) for every strategy its search ranked, on 16 GPUs of AWS: the mixed
cluster is three P3.8xlarge nodes (4x V100, NVLink, 10 Gb/s) and one G4dn.12xlarge (4x T4, PCIe,
50 Gb/s); the homogeneous one four G4dn.12xlarge. benchmarks/calibration/amp_het_cluster.csv
holds each trial's degrees, AMP's layer partition, AMP's predicted cost and the measured
iteration time, as AMP printed them (SOURCES.md there). Each trial is predicted here with the
same placement DeepSpeed used (ranks in (pipeline, data, tensor) order, four per node; a stage
whose replicas sit on both GPU types is a mixed stage, workbench.plan.pools.placement, stepping at
the slower one's pace) and the same partition. Nothing is fitted to these numbers: GPUs are
datasheet figures, coefficients the defaults, software the facts of that stack.

Prints per sweep: Spearman rank correlation of predicted vs measured over the trials that ran,
and the top-1 regret (measured time of the predicted-best trial over the measured best; a pick
that failed to run counts as inf; this planner picks among the trials it predicts to fit), for
this planner and for AMP's cost model, and the median predicted / measured time (scale).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
from pathlib import Path

import numpy as np

from workbench.config import ClusterConfig, ModelConfig
from workbench.plan.cost.coefficients import coefficients
from workbench.plan.cost.columns import columns
from workbench.plan.cost.hardware import match_gpu
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.software import Software
from workbench.plan.pools.cluster import Pool, PoolLink
from workbench.plan.pools.pipeline import LinkArrays
from workbench.plan.pools.placement import Members
from workbench.plan.pools.search import price

DATA = Path(__file__).resolve().parent / "calibration" / "amp_het_cluster.csv"
GPUS_PER_NODE = 4
# AMP's layer list for GPT-2: embedding, a no-op, the transformer layers, 2 no-ops, the LM head,
# a no-op; its partitions are boundaries in that list.
FIRST_LAYER, N_LAYERS = 2, 24
MODEL = ModelConfig(name="gpt2_345m_amp", family="gpt2", n_layers=N_LAYERS, hidden=1024,
                    n_heads=16, n_kv_heads=16, ffn_hidden=4096, vocab=52256, seq_len=1024,
                    bias=True, tie_embeddings=False)  # DeepSpeed pipe keeps a copy per end
# Megatron-LM v1.1.5 + DeepSpeed pipeline, as AMP ran it: --fp16, fp32_allreduce, no
# activation checkpointing, dropout 0.1, fused softmax, gradients reduced after the pipeline.
SOFTWARE = Software(precision="fp16", flash_attention=False, dropout=True, overlap_dp=False,
                    grad_reduce_bytes=4.0)
# node types per sweep (node i holds ranks 4i..4i+3) and the network between P3 and G4dn nodes:
# the P3.8xlarge's 10 Gb/s NIC shared by its 4 GPUs
NODES = {"het_cluster": ["V100", "V100", "V100", "T4"], "homogeneous": ["T4"] * 4}
CROSS = PoolLink(10e9 / 8 / GPUS_PER_NODE, 20e-6)


def _pools(kinds: list[str]) -> dict[str, Pool]:
    out = {}
    for kind in dict.fromkeys(kinds):
        spec = match_gpu(kind)
        out[kind] = Pool(kind, spec, kinds.count(kind),
                         coefficients(ClusterConfig(name=kind, gpu=spec.name)))
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho with average ranks for ties."""
    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for val in np.unique(v):
            r[v == val] = r[v == val].mean()
        return r
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def predict(row: dict[str, str], kinds: list[str]) -> tuple[float, bool]:
    """(predicted seconds per iteration, fits in memory) of one AMP trial."""
    tp, dp, pp, mb = (int(row[k]) for k in ("mp", "dp", "pp", "micro_batch"))
    gb = int(row["global_batch"])
    bounds = [min(max(int(b) - FIRST_LAYER, 0), N_LAYERS) for b in row["amp_partition"].split()]
    layers = np.diff(bounds)
    pools = _pools(kinds)
    names = list(pools)
    stages = []  # each stage's replicas by node type, in rank order (tp <= 4: one node each)
    for s in range(pp):
        members: list[tuple[int, int]] = []
        for d in range(dp):
            p = names.index(kinds[(s * tp * dp + d * tp) // GPUS_PER_NODE])
            if members and members[-1][0] == p:
                members[-1] = (p, members[-1][1] + 1)
            else:
                members.append((p, 1))
        stages.append(members)
    a = columns(dpr=dp, dps=1, tp=tp, pp=1, cp=1, sp=0, mb=mb, rc=0, sched=1, v=1)
    a["ga"] = np.array([gb / (dp * mb)])
    links = LinkArrays.of(list(pools.values()),
                          {pair: CROSS for pair in itertools.permutations(names, 2)})
    p = price(model_shape(MODEL), list(pools.values()), links, SOFTWARE, a,
              np.zeros(1, dtype=np.int64), Members.of([stages]), layers[None, :])
    return float(p.out["step_time_s"][0]), bool(p.out["fits"][0])


def score(rows: list[dict[str, str]], kinds: list[str]) -> dict[str, float]:
    measured = np.array([float(r["measured_s"]) for r in rows])
    amp = np.array([float(r["amp_predicted_s"]) for r in rows])
    ours, fits = zip(*(predict(r, kinds) for r in rows))
    ours_a, fits_a = np.array(ours), np.array(fits)
    ran = np.isfinite(measured)
    best = measured[ran].min()
    pick_ours = int(np.argmin(np.where(fits_a, ours_a, np.inf)))
    pick_amp = int(np.argmin(amp))
    return {"trials": len(rows), "ran": int(ran.sum()),
            "rho_ours": spearman(ours_a[ran], measured[ran]),
            "rho_amp": spearman(amp[ran], measured[ran]),
            "regret_ours": measured[pick_ours] / best - 1,
            "regret_amp": measured[pick_amp] / best - 1,
            "pick_ours": pick_ours, "pick_amp": pick_amp, "best": best,
            "ratio_ours": float(np.median(ours_a[ran] / measured[ran])),
            "ratio_amp": float(np.median(amp[ran] / measured[ran])),
            "failed_predicted_oom": int((~ran & ~fits_a).sum()),
            "ran_predicted_oom": int((ran & ~fits_a).sum())}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", type=Path, default=DATA)
    p.add_argument("--sweep", action="append", help="sweeps to score (default: all)")
    args = p.parse_args(argv)
    with args.csv.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    sweeps = args.sweep or list(dict.fromkeys(r["sweep"] for r in rows))
    print(f"{'sweep':<13}{'trials':>7}{'ran':>5}  {'Spearman ours':>13}{'AMP':>7}"
          f"  {'top-1 regret ours':>17}{'AMP':>8}  OOM agreement")
    for name in sweeps:
        sub = [r for r in rows if r["sweep"] == name]
        if name not in NODES or not sub:
            print(f"{name}: unknown sweep (known: {', '.join(NODES)})", file=sys.stderr)
            return 2
        s = score(sub, NODES[name])
        fails = s["trials"] - s["ran"]
        print(f"{name:<13}{s['trials']:>7}{s['ran']:>5}  {s['rho_ours']:>13.3f}{s['rho_amp']:>7.3f}"
              f"  {s['regret_ours']:>16.1%}{s['regret_amp']:>9.1%}  "
              f"{s['failed_predicted_oom']}/{fails} failed runs predicted OOM, "
              f"{s['ran_predicted_oom']}/{s['ran']} runs wrongly")
        print(f"  median predicted / measured: ours {s['ratio_ours']:.2f}, "
              f"AMP {s['ratio_amp']:.2f}")
        for who in ("ours", "amp"):
            r = sub[int(s[f"pick_{who}"])]
            print(f"  {who:>4} pick: trial {r['trial']} mp{r['mp']} dp{r['dp']} pp{r['pp']} "
                  f"mb{r['micro_batch']} measured {r['measured_s']} s "
                  f"(best measured {s['best']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
