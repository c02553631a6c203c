"""The plots a low-rank run logs as artifacts: stable ranks, and every switch signal."""

from __future__ import annotations

from typing import Any


def plot_stable_ranks(history: dict[str, list[tuple[int, float]]], switch_step: int | None,
                      path: str) -> None:
    """One line per layer (stable rank against step), the switch as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in sorted(history.items()):
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1)
    if switch_step is not None:
        ax.axvline(switch_step, color="k", ls="--", lw=1, label="switch")
    ax.set_xlabel("step")
    ax.set_ylabel("stable rank")
    ax.set_title("stable rank per layer")
    if len(history) <= 16:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_signals(history: dict[str, list[list[float]]], shapes: dict[str, tuple[int, int]],
                 total_steps: int, switch_step: int | None, detector: Any, signal: str,
                 path: str) -> None:
    """Every signal per layer against % of training, so the choice of signal and the switch
    can be audited: the rank the layer would get now, the energy rank of W - W0 (both in % of
    full rank), the top-k subspace overlap between checks, and the smoothed rate of the
    deciding signal with the threshold; each layer's latch as a dot, the switch as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [(axes[0][0], 2, "rank at switch now (% of full)"),
              (axes[0][1], 3, "energy rank of W - W0 (% of full)"),
              (axes[1][0], 4, "top-k subspace overlap with last check"),
              (axes[1][1], 5, f"smoothed |d {signal}| per 1% of training")]
    for name, rows in sorted(history.items()):
        if not rows:
            continue
        full = float(min(shapes[name]))
        x = [100.0 * r[0] / total_steps for r in rows]
        for ax, col, _ in panels:
            y = [abs(r[col]) if col == 5 else r[col] * (100.0 / full if col in (2, 3) else 1.0)
                 for r in rows]
            line, = ax.plot(x, y, lw=0.8, label=name)
            latched = detector.latched.get(name)
            if col == 5 and latched is not None:
                at = min(range(len(x)), key=lambda i: abs(x[i] - latched))
                ax.plot([x[at]], [y[at]], "o", ms=3, color=line.get_color())
    axes[1][1].axhline(detector.crit.threshold, color="k", lw=1, ls=":", label="threshold")
    axes[1][1].set_yscale("log")
    axes[1][1].set_ylim(bottom=detector.crit.threshold / 100)
    for ax, _, title in panels:
        ax.set_title(title, fontsize=9)
        ax.axvline(detector.crit.warmup_pct, color="grey", lw=0.8, ls=":")
        if switch_step is not None:
            ax.axvline(100.0 * switch_step / total_steps, color="k", ls="--", lw=1)
    for ax in axes[1]:
        ax.set_xlabel("% of training")
    if len(history) <= 16:
        axes[0][0].legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

