"""workbench.testing.multirank's fresh groups: timings take a new group of rank processes
every few cases (what a case leaves in its ranks slowed later cases by 20-30%), and that must
change nothing but the processes: same cases, same order, bitwise the same losses."""

from __future__ import annotations

from test_parallel import losses, make_case

from workbench.data.corpus import load as load_data
from workbench.testing.multirank import run_cases

LAYOUTS = {"ddp": ["layout=ddp"], "tp": ["layout=tp"], "fsdp": ["layout=fsdp"]}


def test_a_fresh_group_every_two_cases_changes_only_the_processes(tmp_path) -> None:
    cases = [make_case(name, 2, ov + ["train.steps=3"], tmp_path / "ckpt")
             for name, ov in LAYOUTS.items()]
    for c in cases:
        c.ckpt_dir = ""  # losses only
    data = load_data(cases[0].cfg.data)
    one = run_cases(2, cases, data, str(tmp_path / "one"))
    fresh = run_cases(2, cases, data, str(tmp_path / "fresh"), cases_per_group=2)
    assert [r.get("error") for r in one + fresh] == [None] * 6
    assert [losses(r) for r in fresh] == [losses(r) for r in one]
    assert all(len(losses(r)) == 3 for r in fresh)
    pids = [{rank["pid"] for rank in r["ranks"]} for r in fresh]
    assert pids[0] == pids[1] and not pids[1] & pids[2]  # the third case: new processes
    assert len({frozenset(p) for p in ([{rank["pid"] for rank in r["ranks"]} for r in one])}) == 1
