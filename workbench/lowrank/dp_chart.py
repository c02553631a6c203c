"""The scaling chart: predicted data-parallel efficiency of full rank, low rank and PowerSGD from
8 to 1,024 GPUs (124M, 1.5B and 7B models; 100 Gbit/s Ethernet and 400 Gbit/s InfiniBand), and
the points measured over the rate-limited CPU link beside the model's prediction for that link.

    python -m workbench.lowrank.dp_chart [--out dp_scaling.png] [--tokens-per-gpu 8192]

Why separate from the benchmark: the prediction is cheap (numpy over the cost model) and belongs
in every `+sweep=lowrank_vs_fullrank` report, while the measurement takes minutes and root. The
measured points come from the last `benchmarks/lowrank_scaling.py --record` (dp_measured.json
beside this module, with its date, rate and load); the prediction for that link is recomputed
here from the recorded one-rank step times, so the chart always shows the current model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from workbench.compose import typed
from workbench.config import CONF_DIR, ModelConfig
from workbench.lowrank.dp_scaling import (
    MODES,
    DpNetwork,
    cpu_prediction,
    gpu_curve,
    gpu_network,
)

MEASURED = Path(__file__).with_name("dp_measured.json")
MODELS = {"gpt2_124m": "124M", "gpt2_xl": "1.5B", "llama2_7b": "7B"}
SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
COLORS = {"off": "tab:blue", "lowrank": "tab:orange", "adaptive": "tab:orange",
          "fixed": "tab:red", "powersgd": "tab:green"}
LABELS = {"off": "full rank", "lowrank": "low rank (r = 0.25 min(m,n))",
          "powersgd": "PowerSGD (rank 4)", "adaptive": "adaptive low rank",
          "fixed": "fixed low rank"}
STYLES = ["-", "--", ":"]
MARKERS = {"off": "o", "adaptive": "s", "fixed": "^", "powersgd": "D"}


def load_model(name: str) -> ModelConfig:
    """A model from conf/model without Hydra (the chart is drawn inside a running sweep)."""
    path = Path(CONF_DIR) / "model" / f"{name}.yaml"
    return typed(ModelConfig, OmegaConf.load(path), str(path))


def networks() -> Dict[str, DpNetwork]:
    """The two GPU networks the chart compares: where bytes are the bottleneck, and where not."""
    return {"100 Gbit/s Ethernet (one NIC per 8-GPU node)": gpu_network("eth100", 100, 8),
            "400 Gbit/s InfiniBand (one NIC per GPU)": gpu_network("ib400", 400, 1)}


def predicted(tokens_per_gpu: int) -> Dict[str, Dict[tuple, List[float]]]:
    """{network: {(model, mode): efficiency per SIZES}}."""
    models = {k: load_model(k) for k in MODELS}
    return {name: {(m, mode): [p.efficiency for p in gpu_curve(models[m], mode, network, SIZES,
                                                               tokens_per_gpu)]
                   for m in MODELS for mode in MODES}
            for name, network in networks().items()}


def measured_link_curves(rec: Dict[str, Any]) -> Dict[str, List[tuple]]:
    """{mode: [(world, measured efficiency, predicted efficiency)]} for the recorded link,
    predicted again from the recorded one-rank step times."""
    model = load_model("gpt_small")
    model.seq_len = int(rec.get("seq_len", 128))
    out: Dict[str, List[tuple]] = {}
    cores = float(rec.get("cores", 2))
    for r in rec["rows"]:
        one = rec["points"][f"{r['mode']}/1"]
        p = cpu_prediction(model, r["mode"], one["step_s"], r["world"],
                           float(rec["rate_mbit"]), float(r.get("free_cores", cores)),
                           float(r.get("hook_s", rec.get("powersgd_hook_s", 0.0))),
                           float(one.get("free_cores", cores)), one.get("step_samples", ()),
                           r.get("collective_s"))
        out.setdefault(r["mode"], []).append((r["world"], r["efficiency"], p.efficiency))
    return out


def write(path: Path, tokens_per_gpu: int = 8192, measured: Optional[Path] = None) -> Path:
    """Draw the chart into `path` (PNG); the measured panel only when a record exists."""
    # pyplot loads in most of a second and wants its backend chosen first: imported where the
    # chart is drawn, as the other plots are (the sweep imports this module to draw, tests to
    # read the record)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred = predicted(tokens_per_gpu)
    rec_path = measured or MEASURED
    rec = json.loads(rec_path.read_text()) if rec_path.exists() else None
    fig, axes = plt.subplots(1, 3 if rec else 2, figsize=(17 if rec else 12, 4.8))
    for ax, (name, curves) in zip(axes, pred.items()):
        for (m, mode), eff in curves.items():
            ax.plot(SIZES, eff, STYLES[list(MODELS).index(m)], color=COLORS[mode], lw=1.3,
                    label=f"{MODELS[m]} {LABELS[mode]}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(SIZES, [str(s) for s in SIZES])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("GPUs (data parallel, H100, NVLink inside a node)")
        ax.set_ylabel("predicted scaling efficiency")
        ax.set_title(f"{name}\n{tokens_per_gpu} tokens per GPU per step", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6.5, ncol=1, loc="lower left")
    if rec:
        ax = axes[2]
        for mode, pts in measured_link_curves(rec).items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "-", color=COLORS[mode],
                    label=f"{LABELS[mode]}: predicted")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], MARKERS.get(mode, "o"),
                    color=COLORS[mode], ms=7, alpha=0.8,
                    label=f"{LABELS[mode]}: measured")
        ax.set_xticks([1, 2, 4])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"CPU ranks ({rec.get('cores', 2)} cores: 4 ranks share them)")
        ax.set_ylabel("scaling efficiency")
        ax.set_title(f"gpt_small 14M, gloo over a tc-limited {rec['rate_mbit']:g} Mbit/s "
                     f"veth link\nmeasured {rec.get('when', '?')} (benchmarks/"
                     f"lowrank_scaling.py)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dp_scaling.png")
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    a = ap.parse_args(argv)
    if a.tokens_per_gpu < 1:
        print(f"--tokens-per-gpu: {a.tokens_per_gpu} is not a positive number of tokens",
              file=sys.stderr)
        return 2
    for name, curves in predicted(a.tokens_per_gpu).items():
        print(name)
        print(f"  {'model':<6} {'mode':<9} " + " ".join(f"{s:>5}" for s in SIZES))
        for (m, mode), eff in curves.items():
            print(f"  {MODELS[m]:<6} {mode:<9} " + " ".join(f"{e:>5.2f}" for e in eff))
    print(f"chart: {write(Path(a.out), a.tokens_per_gpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
