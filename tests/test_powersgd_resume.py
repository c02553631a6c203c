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
    """In one DDP bucket (the default) and in DDP's 25 MB buckets (several buckets whose
    layout the restarted job's first iteration changes), in one process group."""
    cases = []
    for one in (True, False):
        ckpt = tmp_path / f"ckpt-{one}"
        cfg = PSGD + [f"lowrank.powersgd_one_bucket={one}"]
        whole = make_case(f"whole-{one}", 2, cfg, ckpt, fingerprint=True)
        # the step-8 checkpoint is dropped (a kill after step 4's), then a fresh job resumes
        cases += [whole, make_case(f"resumed-{one}", 2, cfg, ckpt, f"whole-{one}",
                                   fingerprint=True, keep_up_to_step=4)]
    results = run_cases(2, cases, load_data(cases[0].cfg.data), str(tmp_path / "ranks"),
                        timeout_s=300)
    for a, b in zip(results[::2], results[1::2]):
        assert "error" not in a and "error" not in b, (a.get("traceback"), b.get("traceback"))
        first = {h["step"]: h["loss"] for h in a["history"]}
        again = {h["step"]: h["loss"] for h in b["history"]}
        assert sorted(again) == [4, 5, 6, 7]
        assert all(again[s] == first[s] for s in again)
        assert b["weights"] == a["weights"]
        # compression was on at the resumed steps: far fewer bytes than the dense gradient
        dense = a["history"][0]["comm/allreduce_bytes"]
        assert b["history"][0]["comm/allreduce_bytes"] < 0.5 * dense
    # one bucket: 3 all-reduces of the hook and the loss's; several buckets: 3 per bucket
    assert results[0]["history"][-1]["comm/collectives_per_step"] == 4
    assert results[2]["history"][-1]["comm/collectives_per_step"] > 4
