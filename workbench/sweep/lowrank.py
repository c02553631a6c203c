"""The end of `+sweep=lowrank_vs_fullrank`: the comparison report of its child runs (off,
adaptive, fixed, powersgd), written under the sweep's folder and attached to the parent run.

The sweep itself is an ordinary grid over `lowrank.mode` run by the sweep driver; only this
last step is specific to it (the driver calls `finish` for sweeps whose space varies lowrank.*)."""

from __future__ import annotations

import sys
from typing import Any

from workbench import report
from workbench.track.store import client


def finish(sw: Any) -> None:
    """Build the report from the complete trials; a failure here never loses the sweep."""
    ids = [r.run_id for r in sorted(sw.state.with_status("complete"), key=lambda r: r.number)
           if r.run_id]
    if not ids:
        print("lowrank sweep: no complete trial, no comparison report", file=sys.stderr)
        return
    out = sw.state.folder / "report"
    c = client(sw.uri)
    try:
        result = report.build(c, ids, out)
        scaling_chart(out)
        parent = sw.state.plan.get("parent_run_id")
        if parent:
            report.attach(c, parent, out, result["rows"])
    except Exception as e:
        print(f"lowrank sweep: comparison report failed: {e}", file=sys.stderr)
        return
    print(result["markdown"])
    print(f"predicted data-parallel scaling: {out / 'dp_scaling.png'}", file=sys.stderr)
    print(f"comparison report: {out / 'report.html'}", file=sys.stderr)


def scaling_chart(out: Any) -> None:
    """The cost model's data-parallel scaling chart (full rank vs low rank vs PowerSGD, 8-1,024
    GPUs, with the recorded rate-limited-link measurements) beside the comparison: a prediction,
    so it costs a second or two, not a measurement. A failure leaves the report without it."""
    try:
        from workbench.lowrank import dp_chart

        dp_chart.write(out / "dp_scaling.png")
    except Exception as e:
        print(f"lowrank sweep: scaling chart failed: {e}", file=sys.stderr)
        return
    with open(out / "report.md", "a") as f:
        f.write("\n## Predicted data-parallel scaling (workbench.lowrank.dp_chart)\n\n"
                "![dp_scaling.png](dp_scaling.png)\n")
