"""PowerSGD (lowrank/powersgd.py) resumes bitwise: its error feedback and warm-started Q matrices
are checkpointed per rank and per parameter, so a run killed after a checkpoint and restarted
continues with the same losses and ends with the same weights, although DDP lays out its
buckets differently in the restarted run's first iteration."""

from __future__ import annotations

from test_parallel import make_case

from workbench.data.corpus import load as load_data
from workbench.testing.multirank import run_cases

PSGD = ["layout=ddp", "lowrank=powersgd", "lowrank.powersgd_start_iter=2", "train.steps=8",
        "train.ckpt_every=4"]


def test_powersgd_run_resumed_after_a_checkpoint_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = make_case("whole", 2, PSGD, ckpt, fingerprint=True)
    # the step-8 checkpoint is dropped (a kill after step 4's), then a fresh job resumes
    resumed = make_case("resumed", 2, PSGD, ckpt, "whole", fingerprint=True, keep_up_to_step=4)
    a, b = run_cases(2, [whole, resumed], load_data(whole.cfg.data), str(tmp_path / "ranks"),
                     timeout_s=300)
    assert "error" not in a and "error" not in b, (a.get("traceback"), b.get("traceback"))
    first = {h["step"]: h["loss"] for h in a["history"]}
    again = {h["step"]: h["loss"] for h in b["history"]}
    assert sorted(again) == [4, 5, 6, 7]
    assert all(again[s] == first[s] for s in again)
    assert b["weights"] == a["weights"]
    # compression was on at the resumed steps: far fewer bytes than the dense gradient
    dense = a["history"][0]["comm/allreduce_bytes"]
    assert b["history"][0]["comm/allreduce_bytes"] < 0.5 * dense
