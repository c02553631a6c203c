"""The stable-rank plot a low-rank run logs as an artifact."""

from __future__ import annotations


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
