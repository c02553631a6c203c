"""Accuracy of the cost model on published measurements (benchmarks/calibration/).

Prints, per source group: the median absolute percentage error of the figure the source prints
(TFLOP/s per GPU, MFU, tokens/s per GPU or seconds per iteration); for every sweep of >= 5
layouts (same source, model, GPU count and metric, varying the layout) the Spearman rank
correlation and the top-1 regret (how much worse the predicted-best layout measured than the
measured best), and beside it how well the sheet ranks itself (`twin_agreement`); the
step-time ratio of two kernels over the same layouts, measured and predicted
(`kernel_ratios`); OOM
precision/recall/F1 of `not pred_fits` on rows with a known outcome (every measured row ran;
rows with outcome=oom did not), and the same at each of a few `plan --margin-gib` margins
(what a margin catches against what it rejects); which sources set a coefficient; the error on
published peak memory; and per-GPU memory against Korthikanti et al. Fig. 1 / 7. Beside them,
per source and overall, the development and held-out figures (benchmarks/calibration/
splits.csv: which sources' rows chose a stack fact or coefficient; a source it does not declare
stops the run, exit 2). Nothing here is fitted: the figures are whatever the physical defaults
give (`--interconnect` is a what-if, never a default).

    python benchmarks/costmodel_accuracy.py [--csv PATH ...] [--memory-csv PATH]
        [--interconnect SOURCE=TEXT ...]   # what-if: another fabric for one source's rows
        [--splits PATH]                    # default benchmarks/calibration/splits.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from workbench.config import ModelConfig, TrainConfig
from workbench.errors import ConfigError, InputError
from workbench.layout import Layout
from workbench.plan.accuracy.predict import apply_facts, default_csv, predict_row, read_rows
from workbench.plan.accuracy.scores import (
    LOWER_IS_BETTER,
    check_declared,
    oom_scores,
    prf1,
    read_splits,
    regret,
    report_splits,
    spearman,
    sweep_name,
    sweeps_of,
)
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.hardware import GIB, cluster_for
from workbench.plan.cost.software import Software

PROJECT_CSV = Path(__file__).resolve().parent / "calibration"
# Fields the shared rows leave empty and this project found in their sources (with evidence).
FACTS_CSV = PROJECT_CSV / "shared_row_facts.csv"
# Which source groups' rows chose a fact or coefficient (development) and which none (held_out).
SPLITS_CSV = PROJECT_CSV / "splits.csv"

METRIC_TO_PRED = {"tflops_per_gpu": ("pred_hw_tflops_per_gpu", 1.0),
                  "MFU_pct": ("pred_mfu", 100.0),
                  "tokens_per_sec_per_gpu": ("pred_tokens_per_s_per_gpu", 1.0),
                  "seconds_per_iter": ("pred_step_time_s", 1.0)}


def measured_vs_predicted(rows: list[dict[str, str]]) -> list[tuple[dict[str, str], float, float]]:
    out = []
    for row in rows:
        if (row.get("outcome") or "").strip().lower() == "oom":
            continue  # no figure: scored only as an OOM label
        pred = predict_row(row)
        metric = row.get("metric", "")
        if pred["pred_error"] or metric not in METRIC_TO_PRED or not row.get("value"):
            print(f"  skipped {row['source_group']} {row['model']} n={row['n_gpus']}: "
                  f"{pred['pred_error'] or 'metric ' + metric}")
            continue
        col, scale = METRIC_TO_PRED[metric]
        out.append(({**row, **pred}, float(row["value"]), float(pred[col]) * scale))
    return out


# Sources whose rows set a coefficient's default (see workbench/plan/cost/coefficients.py): their
# error is not an out-of-sample test of that coefficient.
SETS_COEFFICIENT = {
    "sc21_t1": "mm_eff_max[A100]", "sc21_t2": "mm_eff_max[A100], zero3_gather_eff, zero3_overlap",
    "korthikanti_t5": "mm_eff_max[A100]", "torchtitan_old": "mm_eff_max[A100]",
    "torchtitan_asynctp": "async_tp_overlap, fp8_rowwise_cast_bytes",
    "dgxc_nemo2409": "fp8_te_mm_speedup",
}
SWEEP_MIN = 5


MARGINS_GIB = (0.0, 1.0, 2.0, 4.0, 8.0)


def sweep_stats(pairs: list) -> dict[str, list[tuple[str, int, float, float]]]:
    """Per source: (sweep name, layouts, Spearman, top-1 regret) of every sweep of >= SWEEP_MIN
    layouts; a sweep is one source, model, precision-free GPU count and GPU type, varying the
    layout (scores.sweeps_of)."""
    sweeps = sweeps_of(pairs, SWEEP_MIN)
    out: dict[str, list] = defaultdict(list)
    for key, items in sweeps.items():
        m, p = [a for a, _ in items], [b for _, b in items]
        out[key[0]].append((sweep_name(key, sweeps), len(items), spearman(m, p),
                            regret(m, p, key[3] in LOWER_IS_BETTER)))
    return out


LAYOUT_KEYS = ("tp", "pp", "dp", "cp_or_sp", "virtual_stages", "micro_batch", "global_batch",
               "recompute", "zero_or_fsdp", "precision", "stage_layers")


def _twins(pairs: list, by: str = "kernel"):
    """Every ordered pair of one sweep's variants that measured >= SWEEP_MIN common layouts:
    ((source, base, GPUs), tag, other tag, {layout: (measured, time measured, time predicted)}
    for each). A variant is the kernel tag in the model name (by="kernel") or the value of a
    layout column (by="cp_or_sp", "recompute", ...), the layout then being the other columns."""
    keys = LAYOUT_KEYS if by == "kernel" else tuple(k for k in LAYOUT_KEYS if k != by)
    sweeps: dict[tuple[str, str, str], dict[str, dict[tuple, tuple[float, float, float]]]] = \
        defaultdict(lambda: defaultdict(dict))
    for row, meas, pred in pairs:
        base, _, tag = row["model"].partition(" [") if by == "kernel" else \
            (row["model"], "", row.get(by, ""))
        t_m, t_p = (meas, pred) if row["metric"] in LOWER_IS_BETTER else (1 / meas, 1 / pred)
        sweeps[(row["source_group"], base, row["n_gpus"])][tag.rstrip("]")][
            tuple(row.get(k, "") for k in keys)] = (meas, t_m, t_p)
    for sweep, variants in sweeps.items():
        for tag, mine in variants.items():
            for tag2, theirs in variants.items():
                common = sorted(set(mine) & set(theirs))
                if tag2 != tag and len(common) >= SWEEP_MIN:
                    yield sweep, tag, tag2, [(mine[k], theirs[k]) for k in common]


def twin_agreement(pairs: list) -> dict[tuple[str, str], tuple[float, str, int]]:
    """{(source, sweep name): (Spearman, twin's tag, common layouts)} between a sweep's measured
    figures and those of its twin: the same source, model and GPU count measured with another
    kernel tag (`Llama-13B s2k [flash1]` vs `[flash2]`), over the layouts both measured
    (>= SWEEP_MIN); of several twins, the one sharing the most layouts.

    Why: a kernel variant speeds a layout's attention or norm, not its parallel layout, so twins
    should rank their common layouts alike; where they do not, the sheet's run-to-run noise is of
    the order of the layouts' differences. With independent noise of equal size in each sheet, a
    noise-free model's rank correlation with one sheet is about the square root of the twins'
    agreement: the ceiling that a sweep's `rho` can be read against."""
    out: dict[tuple[str, str], tuple[float, str, int]] = {}
    for (src, base, n), tag, tag2, both in _twins(pairs):
        rho = spearman([a[0] for a, _ in both], [b[0] for _, b in both])
        name = f"{base} [{tag}] n={n}" if tag else f"{base} n={n}"
        best = out.get((src, name))
        if best is None or (len(both), rho) > (best[2], best[0]):
            out[(src, name)] = (rho, tag2, len(both))
    return out


def kernel_ratios(pairs: list, by: str = "kernel"
                  ) -> list[tuple[str, str, str, int, float, float]]:
    """[(source, sweep base, "slow / fast" tags, common layouts, measured, predicted)]: the
    median time ratio of the same layouts under two kernels of one sheet (by="kernel": the tag
    in the model name) or two values of a layout column (by="cp_or_sp": sequence parallel on
    and off; "recompute"; "micro_batch"; the rest of the layout equal), as measured and as the
    model predicts it, oriented so that the measured ratio is >= 1.

    Why: the twins' rank agreement says whether a sheet orders its layouts reproducibly; the
    ratio says whether the model prices a choice (flash vs fused softmax vs eager attention,
    sequence parallelism) as the measurements do, which is the question a user asks of it."""
    out = []
    for (src, base, n), tag, tag2, both in _twins(pairs, by):
        if not tag or tag2 <= tag:  # each unordered pair once, untagged rows are no variant
            continue
        m = statistics.median(a[1] / b[1] for a, b in both)
        p = statistics.median(a[2] / b[2] for a, b in both)
        slow, fast = (tag, tag2) if m >= 1 else (tag2, tag)
        out.append((src, f"{base} n={n}", f"{slow} / {fast}", len(both),
                    max(m, 1 / m), p if m >= 1 else 1 / p))
    return sorted(out)


def report_kernel_ratios(pairs: list) -> None:
    for by, what in (("kernel", "two kernels"), ("cp_or_sp", "two cp_or_sp values"),
                     ("recompute", "two recompute policies"), ("micro_batch", "two micro-batches")):
        got = kernel_ratios(pairs, by)
        if got:
            print(f"\n{by} twins: step-time ratio of the same layouts under {what} (median; "
                  "see kernel_ratios):")
        for src, sweep, tags, n, meas, pred in got:
            print(f"  {src:<20}{sweep[:52]:<53}{tags:<34}layouts={n:<3}measured x{meas:.2f} "
                  f"predicted x{pred:.2f}")


def report_layouts(rows: list[dict[str, str]], splits: dict[str, dict[str, str]] | None = None,
                   splits_path: Path = SPLITS_CSV) -> dict[str, float]:
    """Print every figure of the rows (see the module's docstring); return {source: median
    |error| %}. With `splits`, the development and held-out figures side by side as well."""
    pairs = measured_vs_predicted(rows)
    preds = [{**r, **predict_row(r)} for r in rows]
    by_source: dict[str, list] = defaultdict(list)
    for row, meas, pred in pairs:
        by_source[row["source_group"]].append((row, meas, pred))
    sweeps = sweep_stats(pairs)
    print(f"\n{'source':<20}{'n':>4} {'metric':<24}{'MAPE %':>7}{'sweeps':>7}{'min rho':>8}"
          f"{'max regret':>11}  OOM P/R/F1 (labelled)   sets coefficient")
    mapes: dict[str, float] = {}
    for src, items in by_source.items():
        errs = [abs(p - m) / m * 100 for _, m, p in items]
        mapes[src] = statistics.median(errs)
        metrics = sorted({r["metric"] for r, _, _ in items})
        sw = sweeps.get(src, [])
        rho = f"{min(x[2] for x in sw):+.2f}" if sw else "-"
        reg = f"{max(x[3] for x in sw):.1%}" if sw else "-"
        tp, fp, fn, _ = oom_scores([r for r in preds if r["source_group"] == src])
        prec, rec, f1 = prf1(tp, fp, fn)
        oom = f"P {prec:.2f} R {rec:.2f} F1 {f1:.2f}" if tp + fn else f"no OOM rows ({fp} FP)"
        print(f"{src:<20}{len(items):>4} {','.join(metrics)[:23]:<24}{mapes[src]:>7.1f}"
              f"{len(sw):>7}{rho:>8}{reg:>11}  {oom:<24} {SETS_COEFFICIENT.get(src, '')}")
    all_errs = [abs(p - m) / m * 100 for _, m, p in pairs]
    print(f"{'all':<20}{len(pairs):>4} {'':<24}{statistics.median(all_errs):>7.1f}")
    tp, fp, fn, tn = oom_scores(preds)
    prec, rec, f1 = prf1(tp, fp, fn)
    print("OOM as `not pred_fits` (peak + 0 GiB margin <= HBM) over every row with a known "
          f"outcome: tp {tp} fp {fp} fn {fn} tn {tn}; precision {prec:.2f} recall {rec:.2f} "
          f"F1 {f1:.2f}")
    report_margins(preds)
    if splits is not None:
        report_splits(pairs, preds, splits, splits_path)
    print("\nper row (measured -> predicted):")
    for row, meas, pred in pairs:
        print(f"  {row['source_group']:<18}{row['model'][:28]:<29}n={row['n_gpus']:<6}"
              f"tp{row['tp']} pp{row['pp']} dp{row['dp']} {row['precision'][:12]:<12} "
              f"{row['metric']:<22}{meas:>9.1f} -> {pred:>9.1f} ({(pred - meas) / meas:+.0%})"
              f"  mem {row['pred_peak_mem_gib']} GiB fits={row['pred_fits']}")
    print(f"\nsweeps of >= {SWEEP_MIN} layouts (target: Spearman >= 0.9); twin: the same "
          "layouts measured with another kernel, their rank agreement (see twin_agreement):")
    twins = twin_agreement(pairs)
    for src, sw in sweeps.items():
        for name, n, rho, reg in sw:
            twin = twins.get((src, name))
            note = (f"  twin [{twin[1]}] {twin[2]} layouts rho={twin[0]:+.2f}"
                    f" (ceiling ~{max(twin[0], 0.0) ** 0.5:.2f})" if twin else "")
            print(f"  {src:<20}{name:<30}layouts={n:<3}rho={rho:+.2f} top-1 regret={reg:.1%}"
                  + note)
    report_kernel_ratios(pairs)
    report_oom_sweeps(preds)
    mem = [(float(r["peak_mem_gib"]), float(r["pred_peak_mem_gib"])) for r, _, _ in pairs
           if r.get("peak_mem_gib")]
    if mem:
        errs = [abs(p - m) / m * 100 for m, p in mem]
        print(f"\npublished peak memory (torchtitan, max over ranks): {len(mem)} rows, "
              f"median abs error {statistics.median(errs):.1f}%")
    return mapes


def report_oom_sweeps(preds: list[dict[str, str]]) -> None:
    """OOM precision/recall/F1 per labelled sweep (source, model without its kernel tag, GPU
    count): the kernels of one sweep share its memory budget, so they are scored together."""
    groups: dict[tuple[str, str, str], list] = defaultdict(list)
    for r in preds:
        groups[(r["source_group"], r["model"].split(" [")[0], r["n_gpus"])].append(r)
    print("\nOOM per labelled sweep (not pred_fits; target F1 >= 0.9):")
    for (src, model, n), rows in groups.items():
        tp, fp, fn, tn = oom_scores(rows)
        if tp + fn == 0:
            continue
        prec, rec, f1 = prf1(tp, fp, fn)
        print(f"  {src:<20}{model:<30}n={n:<6}oom {tp + fn:<4}ran {fp + tn:<4}"
              f"P {prec:.2f} R {rec:.2f} F1 {f1:.2f}")


def report_margins(preds: list[dict[str, str]]) -> None:
    """What `plan --margin-gib G` trades over every labelled row: OOMs it catches against
    layouts that ran and it would reject, so a user picks a margin from measured outcomes."""
    print("OOM by margin (a layout fits when peak + margin <= HBM; plan --margin-gib):")
    for g in MARGINS_GIB:
        tp, fp, fn, tn = oom_scores(preds, g)
        prec, rec, f1 = prf1(tp, fp, fn)
        print(f"  margin {g:>4g} GiB: precision {prec:.2f} recall {rec:.2f} F1 {f1:.2f}; "
              f"rejects {fp} of the {fp + tn} layouts that ran, lets {fn} of {tp + fn} OOMs "
              "through")


# Korthikanti et al. Fig. 1 models with their Table 5 layouts (TP, PP, interleave, micro-batch).
FIG1 = {"megatron-22B": (48, 6144, 64, 8, 1, 1, 4),
        "gpt3-175B": (96, 12288, 96, 8, 8, 3, 1),
        "turing-530B": (105, 20480, 128, 8, 35, 3, 1),
        "megatron-1T": (128, 25600, 160, 8, 64, 1, 1)}
MODES = {"none": (False, "none"), "seq": (True, "none"), "sel": (False, "selective"),
         "seqsel": (True, "selective"), "full": (False, "full")}


def fig_estimate(name: str, mode: str):
    L, h, a, tp, pp, v, mb = FIG1[name]
    model = ModelConfig(name=name, family="gpt2", n_layers=L, hidden=h, n_heads=a, n_kv_heads=a,
                        ffn_hidden=4 * h, vocab=51200, seq_len=2048, tie_embeddings=True)
    sp, rc = MODES[mode]
    # 2 pp micro-batches: enough that no warm-up is cut short by the step's end (Korthikanti's
    # first stage holds its full pp of them; their Table 5 runs had many more per step)
    lay = Layout(tp=tp, pp=pp, sequence_parallel=sp, micro_batch=mb, grad_accum=max(2 * pp, 1),
                 recompute=rc, pp_schedule="interleaved_1f1b" if v > 1 else "1f1b",
                 virtual_stages=v)
    sw = Software(precision="fp16", flash_attention=False, dropout=True, overlap_dp=False)
    return estimate(model, cluster_for("A100-SXM-80GB", tp * pp), TrainConfig(), lay,
                    software=sw)


def report_memory(path: Path) -> float | None:
    if not path.is_file():
        print(f"no memory CSV at {path}")
        return None
    _, rows = read_rows_loose(path)
    errs = []
    print("\nper-GPU memory vs Korthikanti et al. (target within 10%):")
    none_acts: dict[str, float] = {}
    for name in FIG1:
        none_acts[name] = fig_estimate(name, "none").mem_bytes["mem_activations_bytes"]
    for r in rows:
        est = fig_estimate(r["model"], r["mode"])
        acts = est.mem_bytes["mem_activations_bytes"]
        if r["figure"] == "Fig1":
            states = sum(est.mem_bytes[k] for k in ("mem_params_bytes", "mem_grads_bytes",
                                                    "mem_optimizer_bytes")) / GIB
            for what, meas, pred in (("params+optimizer",
                                      float(r["params_and_optimizer_GiB_per_gpu"]), states),
                                     ("activations", float(r["activations_GiB_per_gpu"]),
                                      acts / GIB)):
                err = (pred - meas) / meas * 100
                errs.append(abs(err))
                print(f"  Fig1 {r['model']:<13}{r['mode']:<7}{what:<17}{meas:>8.2f} -> "
                      f"{pred:>8.2f} GiB ({err:+.1f}%)")
        else:
            meas = float(r["activation_pct_of_none"])
            pred = acts / none_acts[r["model"]] * 100
            err = (pred - meas) / meas * 100
            errs.append(abs(err))
            print(f"  Fig7 {r['model']:<13}{r['mode']:<7}{'activation %':<17}{meas:>8.2f} -> "
                  f"{pred:>8.2f} %   ({err:+.1f}%)")
    worst = max(errs)
    print(f"memory: median abs error {statistics.median(errs):.1f}%, max {worst:.1f}%")
    return worst


def read_rows_loose(path: Path):
    import csv

    with path.open(newline="", encoding="utf-8") as fh:
        r = csv.DictReader(fh)
        return r.fieldnames, list(r)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", type=Path, action="append", default=None,
                   help="rows to score (repeatable; default: published_layouts.csv and this "
                        "project's other benchmarks/calibration/*_layouts.csv)")
    p.add_argument("--memory-csv", type=Path, default=None)
    p.add_argument("--interconnect", action="append", default=[], metavar="SOURCE=TEXT",
                   help="what-if: score SOURCE's rows as if their fabric were TEXT (as the CSV's "
                        "interconnect column says it, e.g. '1x200Gb/s HDR IB per node')")
    p.add_argument("--splits", type=Path, default=SPLITS_CSV,
                   help="source_group -> development | held_out (default: "
                        "benchmarks/calibration/splits.csv); every scored source must be in it")
    args = p.parse_args(argv)
    fabric = dict(x.partition("=")[::2] for x in args.interconnect)
    if bad := [x for x in args.interconnect if "=" not in x or not x.partition("=")[2]]:
        print(f"error: --interconnect {bad[0]!r}: expected SOURCE=TEXT", file=sys.stderr)
        return 2
    paths = args.csv or [default_csv(), *sorted(p for p in PROJECT_CSV.glob("*_layouts.csv")
                                                if p != default_csv())]
    rows: list[dict[str, str]] = []
    for path in paths:
        got = read_rows(path)[1]
        if path == default_csv() and FACTS_CSV.is_file():  # what this project found about them
            got, filled = apply_facts(got, read_rows_loose(FACTS_CSV)[1])
            print(f"facts: {filled} empty fields of {path.name} filled from {FACTS_CSV.name}")
        rows += [{**r, "interconnect": fabric[r["source_group"]]}
                 if r.get("source_group") in fabric else r for r in got]
        print(f"rows: {len(got)} from {path}")
    try:
        splits = read_splits(args.splits)
        check_declared(rows, splits, args.splits)
    except (ConfigError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report_layouts(rows, splits, args.splits)
    report_memory(args.memory_csv or paths[0].with_name("korthikanti2022_memory.csv"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
