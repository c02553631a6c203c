"""Every command keeps the error contract: bad input ends with one `error: ...` line naming what
is wrong, exit status 2, and nothing written. The commands' mains run in this process (a
subprocess per case costs seconds of imports each); test_config and the CLI tests cover the
same contract through real subprocesses."""

from __future__ import annotations

import importlib

import pytest

from workbench.cli import guarded

PACKAGES = ("workbench.sweep", "workbench.plan", "workbench.train")  # commands in __main__
STORE = "+store"  # the case runs against an existing (empty) MLflow store
CASES = [
    ("workbench.report", ["x", "--no-such-flag"], "unrecognized arguments"),
    ("workbench.report", [], "the following arguments are required: runs"),
    ("workbench.report", ["0123456789abcdef"], "no MLflow store there"),
    ("workbench.report", [STORE, "0123456789abcdef"], "neither a run id nor a sweep"),
    ("workbench.report", [STORE, "x", "--parent", "0123456789abcdef"],
     "--parent='0123456789abcdef'"),
    ("workbench.rerun", [], "usage: python -m workbench.rerun"),
    ("workbench.rerun", ["0123456789abcdef"], "no MLflow store there"),
    ("workbench.rerun", [STORE, "0123456789abcdef"], "no such run"),
    ("workbench.train", ["/no/such/job.json"], "does not exist"),
    ("workbench.sweep", ["status"], "sweep"),
    ("workbench.plan", ["--no-such-flag"], "unrecognized arguments"),
    ("workbench.run", ["layout=nope"], "layout='nope': no such option; valid:"),
    ("workbench.track.server", ["restart"], "invalid choice: 'restart'"),
    ("workbench.track.server", ["start", "--dir", "srv", "--workers", "0"], "--workers=0"),
    ("workbench.track.server", ["start", "--dir", "srv", "--auth", "--auth-file", "/no/such"],
     "--auth-file /no/such: no such file"),
]


@pytest.mark.parametrize("module,args,expect", CASES, ids=[f"{m}-{i}" for i, (m, _, _) in
                                                          enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(workdir, capsys, module, args, expect):
    if STORE in args:
        from mlflow.tracking import MlflowClient

        MlflowClient().search_experiments()  # creates the sqlite store of MLFLOW_TRACKING_URI
        capsys.readouterr()  # MLflow's own log lines about creating it
        args = [a for a in args if a != STORE]
    before = sorted(p.name for p in workdir.iterdir())
    main = guarded(importlib.import_module(f"{module}.__main__" if module in PACKAGES
                                           else module).main)
    with pytest.raises(SystemExit) as ended:
        main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert ended.value.code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert expect in lines[0], lines[0]
    leftovers = sorted(p.name for p in workdir.iterdir() if p.name not in before)
    assert leftovers == [], leftovers
