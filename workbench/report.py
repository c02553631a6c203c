"""`python -m workbench.report RUN_OR_SWEEP... [--out DIR] [--parent RUN_ID]`: a comparison of
any set of MLflow runs: loss and val_loss against tokens and against wall-clock, tokens/s,
measured bytes per step, final val_loss gaps to a baseline, the low-rank switch step and
ranks. Plots are PNG, tables markdown and HTML; with --parent (or a sweep) they are logged as
artifacts of that run, so the comparison sits beside the runs in the MLflow UI.

An argument is a run id, a parent run id (its child runs), a run folder (its run),
`experiment:NAME` (an MLflow experiment's finished runs), or a sweep (a name under sweeps/ or a
folder holding trials.json). Runs are labelled by their `lowrank.mode` param, and by the params
that differ between them when modes repeat; the baseline for gaps is the first run with
`lowrank.mode=off`, else the first. Several seeds of one configuration add an "Across seeds"
table (workbench.compare).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.cli import ArgParser, guarded
from workbench.compare import SEED, SEED_COLUMNS, labels, seed_rows
from workbench.errors import InputError
from workbench.places import SWEEPS_DIR
from workbench.track.store import client

SERIES = ("loss", "val_loss", "tokens_per_s", "comm/bytes_per_step", "params/trainable",
          "step_time_s", "lowrank/switch_step", "lowrank/switch_forced")


@dataclass
class RunData:
    """What the report needs of one run, read once from MLflow."""

    run_id: str
    label: str
    params: dict[str, str]
    series: dict[str, list[tuple[int, float, int]]]  # key -> [(step, value, timestamp_ms)]
    ranks: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return int(self.params.get("train.global_batch", 0)) * \
            int(self.params.get("model.seq_len", 0))

    def values(self, key: str) -> list[float]:
        return [v for _, v, _ in self.series.get(key, [])]

    def final(self, key: str) -> float:
        vals = self.series.get(key, [])
        return vals[-1][1] if vals else math.nan

    def median(self, key: str, skip_first: int = 1) -> float:
        vals = self.values(key)[skip_first:] or self.values(key)
        return float(statistics.median(vals)) if vals else math.nan

    def switch_step(self) -> int | None:
        vals = self.values("lowrank/switch_step")
        return int(vals[-1]) if vals else None

    def steady_bytes(self) -> float:
        """Median measured bytes per step over the last quarter of training: after any switch
        (low rank) or start iteration (PowerSGD), which is what the method costs at steady
        state."""
        pts = self.series.get("comm/bytes_per_step", [])
        if not pts:
            return math.nan
        last = pts[-max(1, len(pts) // 4):]
        return float(statistics.median(v for _, v, _ in last))


def resolve(c: Any, args: Sequence[str], sweeps_dir: str = SWEEPS_DIR) -> list[str]:
    """Run ids for the arguments: sweeps (trials.json), parents (their children), runs, and run
    folders (the run their job file names: a user who branched runs knows their folders)."""
    from mlflow.exceptions import MlflowException

    from workbench.job import JOB_NAME, Job

    out: list[str] = []
    for arg in args:
        if arg.startswith("experiment:"):
            out += _experiment_runs(c, arg[len("experiment:"):])
            continue
        if (Path(arg) / JOB_NAME).is_file() and Job.load(arg).run_id:
            out.append(Job.load(arg).run_id)
            continue
        folder = Path(arg) if Path(arg).is_dir() else Path(sweeps_dir) / arg
        if (folder / "trials.json").exists():
            trials = json.loads((folder / "trials.json").read_text())
            recs = trials.values() if isinstance(trials, dict) else trials
            out += [r["run_id"] for r in sorted(recs, key=lambda r: r.get("number", 0))
                    if r.get("run_id") and r.get("status") == "complete"]
            continue
        try:
            run = c.get_run(arg)
        except MlflowException:
            raise InputError(f"{arg}: neither a run id nor a sweep (no {folder}/trials.json)"
                             ) from None
        children = c.search_runs([run.info.experiment_id],
                                 filter_string=f"tags.mlflow.parentRunId = '{arg}'",
                                 order_by=["attributes.start_time ASC"])
        out += [r.info.run_id for r in children] or [arg]
    return list(dict.fromkeys(out))


def _experiment_runs(c: Any, name: str) -> list[str]:
    """The finished runs of an MLflow experiment, oldest first (a --multirun grid has no parent
    run to name)."""
    exp = c.get_experiment_by_name(name)
    if exp is None:
        raise InputError(f"experiment:{name}: no such MLflow experiment in {c.tracking_uri}")
    runs = c.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                         order_by=["attributes.start_time ASC"])
    return [r.info.run_id for r in runs]


def load(c: Any, run_ids: Sequence[str]) -> list[RunData]:
    raw = [c.get_run(rid) for rid in run_ids]
    names = labels([dict(r.data.params) for r in raw], [dict(r.data.tags) for r in raw])
    runs = []
    for run, label in zip(raw, names):
        rid, series = run.info.run_id, {}
        for key in SERIES:
            hist = c.get_metric_history(rid, key)
            series[key] = sorted((m.step, m.value, m.timestamp) for m in hist)
        ranks = {k[5:]: v for k, v in run.data.metrics.items() if k.startswith("rank/")}
        runs.append(RunData(rid, label, dict(run.data.params), series, ranks,
                            dict(run.data.tags)))
    return runs


def baseline(runs: Sequence[RunData]) -> RunData:
    return next((r for r in runs if r.params.get("lowrank.mode") == "off"), runs[0])


def summary_rows(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """One row per run: the numbers the comparison is about."""
    base = baseline(runs)
    b_val, b_bytes = base.final("val_loss"), base.steady_bytes()
    rows = []
    for r in runs:
        steps = len(r.values("loss"))
        val, by = r.final("val_loss"), r.steady_bytes()
        sw = r.switch_step()
        ranks = [v for v in r.ranks.values()]
        rows.append({
            "run": r.label, "run_id": r.run_id, "steps": steps,
            "tokens": steps * r.tokens_per_step,
            "final_val_loss": val,
            "val_loss_gap_pct": 100.0 * (val - b_val) / b_val if b_val else math.nan,
            "tokens_per_s": r.median("tokens_per_s"),
            "bytes_per_step": by,
            "bytes_reduction_pct": 100.0 * (1 - by / b_bytes) if b_bytes else math.nan,
            "params_trainable": r.final("params/trainable"),
            "switch_step": sw if sw is not None else "",
            "switch_frac": f"{sw / steps:.3f}" if sw is not None and steps else "",
            "switch_forced": ("yes" if r.final("lowrank/switch_forced") == 1 else "no")
            if sw is not None and r.params.get("lowrank.mode") == "adaptive" else "",
            "layers_lowrank": len(ranks),
            "mean_rank": f"{statistics.mean(ranks):.1f}" if ranks else "",
        })
    return rows


COLUMNS = ("run", "steps", "tokens", "final_val_loss", "val_loss_gap_pct", "tokens_per_s",
           "bytes_per_step", "bytes_reduction_pct", "params_trainable", "switch_step",
           "switch_frac", "switch_forced", "layers_lowrank", "mean_rank", "run_id")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.4e}"
    return str(v)


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def html(rows: Sequence[dict[str, Any]], ranks: str, columns: Sequence[str] = COLUMNS,
         images: Sequence[str] = (), seeds: Sequence[dict[str, Any]] = ()) -> str:
    import html as h

    def table(rs: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
        head = "".join(f"<th>{h.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{h.escape(_fmt(r.get(c, '')))}</td>"
                                        for c in cols) + "</tr>" for r in rs)
        return f"<table border='1' cellspacing='0' cellpadding='3'><tr>{head}</tr>{body}</table>"

    imgs = "".join(f'<p><img src="{h.escape(i)}" alt="{h.escape(i)}"></p>' for i in images)
    across = f"<h2>Across seeds</h2>{table(seeds, SEED_COLUMNS)}" if seeds else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>workbench comparison"
            f"</title></head><body><h1>Comparison of {len(rows)} runs</h1>"
            f"{table(rows, columns)}{across}"
            f"<h2>Ranks after the switch</h2><pre>{h.escape(ranks)}</pre>{imgs}</body></html>")


def rank_table(runs: Sequence[RunData]) -> str:
    with_ranks = [r for r in runs if r.ranks]
    if not with_ranks:
        return "(no run switched to low rank)"
    layers = sorted({k for r in with_ranks for k in r.ranks})
    rows = [{"layer": n, **{r.label: int(r.ranks[n]) if n in r.ranks else "dense"
                            for r in with_ranks}} for n in layers]
    return markdown(rows, ["layer"] + [r.label for r in with_ranks])


def _label_loss_axes(axes: Any, xlabel: str) -> None:
    for ax, key in zip(axes, ("loss", "val_loss")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(key)
        ax.legend()


def plots(runs: Sequence[RunData], out: Path) -> list[str]:
    """loss/val_loss against tokens and wall-clock, tokens/s and bytes per step; file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        names.append(name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        tps = r.tokens_per_step
        loss = r.series.get("loss", [])
        axes[0].plot([(s + 1) * tps for s, _, _ in loss], [v for _, v, _ in loss], lw=0.8,
                     label=r.label)
        val = r.series.get("val_loss", [])
        axes[1].plot([s * tps for s, _, _ in val], [v for _, v, _ in val], marker="o", ms=3,
                     label=r.label)
        if r.switch_step() is not None:
            for ax in axes:
                ax.axvline(r.switch_step() * tps, ls=":", lw=0.8, color="gray")
    _label_loss_axes(axes, "tokens")
    save(fig, "loss_vs_tokens.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        for ax, key in zip(axes, ("loss", "val_loss")):
            pts = r.series.get(key, [])
            t0 = (r.series.get("loss") or pts or [(0, 0, 0)])[0][2]
            ax.plot([(ts - t0) / 1000 for _, _, ts in pts], [v for _, v, _ in pts],
                    lw=0.8, marker="o" if key == "val_loss" else None, ms=3, label=r.label)
    _label_loss_axes(axes, "wall-clock since first step (s)")
    save(fig, "loss_vs_wallclock.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        pts = r.series.get("comm/bytes_per_step", [])
        axes[0].plot([s for s, _, _ in pts], [v for _, v, _ in pts], lw=1, label=r.label)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("measured bytes per step per rank")
    axes[0].legend()
    axes[1].bar([r.label for r in runs], [r.median("tokens_per_s") for r in runs])
    axes[1].set_ylabel("median tokens/s")
    save(fig, "bytes_and_throughput.png")
    return names


def signal_plots(c: Any, runs: Sequence[RunData], out: Path) -> list[str]:
    """Each adaptive run's switch-signal plot (lowrank/signals.png), copied beside the report:
    the switch's audit trail (every layer's signals, threshold, latches) next to its cost."""
    import shutil
    import tempfile

    names = []
    for r in runs:
        if r.params.get("lowrank.mode") != "adaptive":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = c.download_artifacts(r.run_id, "lowrank/signals.png", tmp)
            except Exception:  # an older run, or one stopped before it plotted
                continue
            name = f"signals_{r.label.replace('#', '_')}.png"
            shutil.copy(got, out / name)
            names.append(name)
    return names


def build(c: Any, run_ids: Sequence[str], out: Path) -> dict[str, Any]:
    """Write the report files into `out`; returns the rows and file names."""
    if not run_ids:
        raise InputError("no runs to compare (a sweep with no complete trial?)")
    out.mkdir(parents=True, exist_ok=True)
    runs = load(c, run_ids)
    rows = summary_rows(runs)
    seeds = seed_table(runs)
    ranks = rank_table(runs)
    images = plots(runs, out) + signal_plots(c, runs, out)
    across = ("\n\n## Across seeds\n\nGroups of runs that differ only in `train.seed`; gaps "
              "are paired by seed against the baseline's group, with 95% t intervals.\n\n"
              + markdown(seeds, SEED_COLUMNS)) if seeds else ""
    md = (f"# Comparison of {len(runs)} runs\n\nbaseline: `{baseline(runs).label}` "
          f"(gaps and byte reductions are relative to it; bytes: median of the last quarter "
          f"of steps, measured)\n\n{markdown(rows)}{across}\n\n## Ranks after the switch\n\n"
          f"{ranks}\n\n" + "\n".join(f"![{i}]({i})" for i in images) + "\n")
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(html(rows, ranks, images=images, seeds=seeds))
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    files = ["report.md", "report.html", "summary.json", *images]
    if seeds:
        (out / "seeds.json").write_text(json.dumps(seeds, indent=1, default=str))
        files.insert(3, "seeds.json")
    return {"rows": rows, "seeds": seeds, "files": files, "markdown": md}


def seed_table(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Runs grouped by everything but their seed, against the baseline's group
    (workbench.compare); empty without two seeds of one configuration."""
    groups = labels([r.params for r in runs], [r.tags for r in runs], ignore=(SEED,),
                    unique=False)
    base = groups[runs.index(baseline(runs))]
    return seed_rows(runs, groups, base)


def attach(c: Any, parent_run_id: str, out: Path, rows: Sequence[dict[str, Any]]) -> None:
    """The report as artifacts of the parent run, and its key numbers as parent metrics."""
    from mlflow.entities import Metric

    from workbench.track.tracker import with_retries

    with_retries(c.log_artifacts, parent_run_id, str(out), "report")
    now = 0
    ms = []
    for r in rows:
        for key in ("final_val_loss", "bytes_per_step", "tokens_per_s", "val_loss_gap_pct",
                    "bytes_reduction_pct"):
            v = r.get(key)
            if isinstance(v, float) and math.isfinite(v):
                ms.append(Metric(f"{r['run']}/{key}", v, now, 0))
    if ms:
        with_retries(c.log_batch, parent_run_id, metrics=ms)


def _known_run(c: Any, run_id: str, key: str) -> None:
    """Checked before anything is written, so a typo leaves no half-made report behind."""
    from mlflow.exceptions import MlflowException

    try:
        c.get_run(run_id)
    except MlflowException:
        raise InputError(f"{key}={run_id!r}: no such run in {c.tracking_uri}") from None


@guarded
def main(argv: list[str]) -> int:
    ap = ArgParser(prog="python -m workbench.report", description=__doc__)
    ap.add_argument("runs", nargs="+", help="run ids, parent run ids or sweeps")
    ap.add_argument("--out", default="", help="folder for the report (default reports/<first>)")
    ap.add_argument("--uri", default="",
                    help="MLflow tracking URI (default $MLFLOW_TRACKING_URI or ./mlflow.db)")
    ap.add_argument("--parent", default="", help="log the report as artifacts of this run")
    ap.add_argument("--sweeps-dir", default=SWEEPS_DIR)
    a = ap.parse_args(argv)
    c = client(a.uri, create=False)
    if a.parent:
        _known_run(c, a.parent, "--parent")
    ids = resolve(c, a.runs, a.sweeps_dir)
    out = Path(a.out or Path("reports") / Path(a.runs[0]).name)
    result = build(c, ids, out)
    if a.parent:
        attach(c, a.parent, out, result["rows"])
    print(markdown(result["rows"]))
    print(f"report: {out / 'report.html'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
