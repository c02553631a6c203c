"""The end of `+sweep=data_mixture`: how the target validation loss depends on the mixture.

Data-mixture studies fit small proxy models on many candidate mixtures and read the relation
between weights and loss off a fitted model, to choose the large run's mixture. Here: each
complete trial's normalized weights and final losses (target and per source), a least-squares
Scheffe polynomial of the target loss in the weights (linear; quadratic once the trials
outnumber its terms), its fit quality, and the mixture on a simplex grid it predicts best.
Written under the sweep's folder and attached to the parent run (`report/` artifacts).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from workbench.track.store import client
from workbench.track.tracker import with_retries

PREFIX = "data.weights."


def _features(w: np.ndarray, quadratic: bool) -> np.ndarray:
    """Scheffe terms: w_i (no intercept: the weights sum to 1), then w_i * w_j for i < j."""
    cols = [w[:, i] for i in range(w.shape[1])]
    if quadratic:
        cols += [w[:, i] * w[:, j] for i, j in itertools.combinations(range(w.shape[1]), 2)]
    return np.stack(cols, axis=1)


def fit(weights: np.ndarray, loss: np.ndarray, names: Sequence[str]) -> Dict[str, Any]:
    """The fitted relation and the best mixture it predicts on a 5% simplex grid."""
    k = weights.shape[1]
    quadratic = len(loss) > k + k * (k - 1) // 2
    x = _features(weights, quadratic)
    coef, *_ = np.linalg.lstsq(x, loss, rcond=None)
    pred = x @ coef
    ss_res = float(((loss - pred) ** 2).sum())
    ss_tot = float(((loss - loss.mean()) ** 2).sum())
    terms = list(names) + ([f"{a}*{b}" for a, b in itertools.combinations(names, 2)]
                           if quadratic else [])
    grid = np.array([p for p in itertools.product(range(21), repeat=k) if sum(p) == 20]) / 20
    best = grid[int(np.argmin(_features(grid, quadratic) @ coef))]
    return {"model": "quadratic" if quadratic else "linear",
            "coefficients": dict(zip(terms, map(float, coef))),
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "rmse": (ss_res / len(loss)) ** 0.5, "predicted": pred.tolist(),
            "best_weights": dict(zip(names, map(float, best))),
            "best_predicted_loss": float((_features(best[None], quadratic) @ coef)[0])}


def _trials(sw: Any, c: Any) -> Tuple[List[str], List[Dict[str, Any]]]:
    done = sorted(sw.state.with_status("complete"), key=lambda r: r.number)
    names = sorted({k[len(PREFIX):] for r in done for k in r.params if k.startswith(PREFIX)})
    rows = []
    for r in done:
        if not r.run_id:
            continue
        raw = np.array([float(r.params.get(PREFIX + n, 0.0)) for n in names])
        metrics = with_retries(c.get_run, r.run_id).data.metrics
        rows.append({"trial": r.number, "run_id": r.run_id,
                     "weights": dict(zip(names, (raw / raw.sum()).tolist())),
                     "val_loss": metrics.get("val_loss", float("nan")),
                     **{f"val_loss/{n}": metrics.get(f"val_loss/{n}", float("nan"))
                        for n in names}})
    return names, rows


def write(names: Sequence[str], rows: List[Dict[str, Any]], out: Path) -> Dict[str, Any]:
    """report.json, report.md and fit.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    w = np.array([[r["weights"][n] for n in names] for r in rows])
    loss = np.array([r["val_loss"] for r in rows])
    result = fit(w, loss, names)
    head = "| trial | " + " | ".join(f"w_{n}" for n in names) + " | target val_loss | " + \
        " | ".join(f"val_loss/{n}" for n in names) + " | fitted |"
    lines = ["# Data mixture sweep", "", head, "|" + "---|" * (2 * len(names) + 3)]
    for r, p in zip(rows, result["predicted"]):
        lines.append(f"| {r['trial']} | " + " | ".join(f"{r['weights'][n]:.3f}" for n in names)
                     + f" | {r['val_loss']:.4f} | "
                     + " | ".join(f"{r[f'val_loss/{n}']:.4f}" for n in names) + f" | {p:.4f} |")
    coefs = ", ".join(f"{k}: {v:+.4f}" for k, v in result["coefficients"].items())
    best = ", ".join(f"{k}={v:.2f}" for k, v in result["best_weights"].items())
    lines += ["", f"Fit ({result['model']} Scheffe polynomial, target val_loss = sum of "
              f"coefficient x term): {coefs}; R^2 {result['r2']:.3f}, RMSE "
              f"{result['rmse']:.4f} over {len(rows)} trials.", "",
              f"Best predicted mixture: {best} (predicted val_loss "
              f"{result['best_predicted_loss']:.4f})."]
    markdown = "\n".join(lines) + "\n"
    (out / "report.md").write_text(markdown)
    (out / "report.json").write_text(json.dumps({"sources": list(names), "trials": rows,
                                                 "fit": result}, indent=1))
    _plot(names, w, loss, np.array(result["predicted"]), out / "fit.png")
    return {"markdown": markdown, **result}


def _plot(names: Sequence[str], w: np.ndarray, loss: np.ndarray, pred: np.ndarray,
          path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4 * (len(names) + 1), 3.5))
    for ax, i in zip(axes, range(len(names))):
        ax.scatter(w[:, i], loss)
        ax.set_xlabel(f"weight of {names[i]}")
        ax.set_ylabel("target val_loss")
    axes[-1].scatter(pred, loss)
    lo, hi = float(min(loss.min(), pred.min())), float(max(loss.max(), pred.max()))
    axes[-1].plot([lo, hi], [lo, hi], "k--", lw=1)
    axes[-1].set_xlabel("fitted")
    axes[-1].set_ylabel("observed")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def finish(sw: Any) -> None:
    """Build and attach the report; a failure here never loses the sweep."""
    c = client(sw.uri)
    names, rows = _trials(sw, c)
    if len(rows) < 2:
        print("data mixture sweep: fewer than 2 complete trials, no report", file=sys.stderr)
        return
    out = sw.state.folder / "mixture_report"
    try:
        result = write(names, rows, out)
        parent = sw.state.plan.get("parent_run_id")
        if parent:
            with_retries(c.log_artifacts, parent, str(out), "report")
            for n, v in result["best_weights"].items():
                with_retries(c.log_metric, parent, f"mixture/best_w_{n}", v)
            with_retries(c.log_metric, parent, "mixture/fit_r2", result["r2"])
    except Exception as e:
        print(f"data mixture sweep: report failed: {e}", file=sys.stderr)
        return
    print(result["markdown"])
    print(f"mixture report: {out / 'report.md'}", file=sys.stderr)
