"""Long runs: learning-rate schedules that can be continued (wsd, constant), and runs started from
another run's checkpoint (`train.init_from`): a continued run repeats its parent's losses bitwise,
a cool-down branched off a checkpoint starts from its weights, a checkpoint loads into another
layout and world size in both directions, lineage is recorded, and bad input exits 2 with one
line recording nothing."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import FAST, metric_series
from readme_blocks import block_with, make_clone, run_block

from workbench.config import RunConfig
from workbench.run import main
from workbench.train.optimizer import lr_at

CONSTANT = [o for o in FAST if not o.startswith("train.steps")] + [
    "train.lr_schedule=constant", "train.keep_ckpts=3"]


def _cfg(**train) -> RunConfig:
    cfg = RunConfig()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_wsd_is_stable_then_decays_1_sqrt_to_the_floor_and_constant_stays():
    cfg = _cfg(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, lr_schedule="wsd",
               decay_steps=20)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[:10] == [pytest.approx((s + 1) / 10) for s in range(10)]
    assert lrs[10:80] == [1.0] * 70
    assert lrs[80] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(1 / 20)))
    assert lrs[89] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(10 / 20)))
    assert lrs[99] == pytest.approx(0.1) and all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    cfg.train.decay_steps = 0  # 20% of the steps
    assert [lr_at(s, cfg) for s in (79, 80)] == [1.0, pytest.approx(0.1 + 0.9 * (1 - 0.05**.5))]
    cfg.train.lr_schedule = "constant"
    assert {lr_at(s, cfg) for s in range(10, 100)} == {1.0}
    cfg.train.lr_schedule = "cosine"  # unchanged: the floor is reached after the last step
    assert lr_at(10, cfg) == 1.0 and lr_at(55, cfg) == pytest.approx(0.55)


def test_checkpoints_at_multiples_of_keep_every_are_kept_for_good(tmp_path):
    from workbench.train.checkpoint.folder import CheckpointDir, expired
    from workbench.train.engine.bookkeeping import solo

    assert expired([3, 6, 9, 12, 15], keep=2) == [3, 6, 9]
    assert expired([3, 6, 9, 12, 15], keep=2, keep_every=6) == [3, 9]
    ckpt = CheckpointDir(tmp_path, solo(), keep=1, keep_every=6)
    for step in (3, 6, 9, 12, 15):
        ckpt.save(step, {"step": step})
    assert ckpt.steps() == [6, 12, 15] and all(ckpt.verify(s) is None for s in ckpt.steps())


def _ckpt(run_dir, step: int) -> Path:
    """A run's checkpoint folder of `step` (in the one layout it ran in)."""
    (found,) = Path(run_dir).glob(f"checkpoints/*/step_{step:08d}")
    return found


def _runs():
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.get_experiment_by_name("workbench")
    runs = client.search_runs([exp.experiment_id])
    return {Path(r.data.tags["wb.run_dir"]).name: r for r in runs}


def test_a_continued_run_repeats_its_parents_losses_and_resumes_as_itself(workdir, capsys):
    assert main(CONSTANT + ["train.steps=12", "train.run_dir=runs/parent"]) == 0
    child = ["train.steps=12", "train.run_dir=runs/child",
             f"train.init_from={_ckpt('runs/parent', 6)}"]
    assert main(CONSTANT + child) == 0
    runs = _runs()
    parent, kid = runs["parent"].info.run_id, runs["child"]
    assert kid.data.params["train.init_from"] == str(workdir / _ckpt("runs/parent", 6))
    assert (kid.data.tags["wb.init_step"], kid.data.tags["wb.parent_run_id"]) == ("6", parent)
    theirs = metric_series(parent, "loss")
    assert metric_series(kid.info.run_id, "loss") == theirs[6:]  # bitwise, steps 6..11
    assert metric_series(kid.info.run_id, "val_loss")[-1] == metric_series(parent, "val_loss")[-1]
    # The same command again resumes the child from its own checkpoint; naming the parent's
    # folder is naming the checkpoint it was found in; another checkpoint is another run.
    again = child[:2] + ["train.init_from=runs/parent"]
    assert main(CONSTANT + again) == 0
    assert "resuming run in" in capsys.readouterr().err and len(_runs()) == 2
    with pytest.raises(SystemExit) as e:
        main(CONSTANT + child[:2] + [f"train.init_from={_ckpt('runs/parent', 12)}"])
    assert e.value.code == 2 and "train.init_from" in capsys.readouterr().err
    # weights only: step 0, the warm-up again, from trained weights (a lower first loss)
    assert main(CONSTANT + ["train.steps=4", "train.run_dir=runs/w", "train.init_state=weights",
                            "train.init_from=runs/parent"]) == 0
    w = metric_series(_runs()["w"].info.run_id, "loss")
    assert [s for s, _ in w] == [0, 1, 2, 3] and w[0][1] < theirs[0][1] - 0.5
    # a Llama-family model continued at a longer context with a larger RoPE base (the tables
    # are computed, not saved): the same weights, a new sequence length
    assert main(CONSTANT + ["train.steps=14", "train.run_dir=runs/long", "model.seq_len=256",
                            "model.rope_theta=500000", "train.init_from=runs/parent"]) == 0
    assert _runs()["long"].data.params["model.seq_len"] == "256"


@pytest.fixture(scope="module")
def parent(tmp_path_factory, cache_dir) -> Path:
    """A 12-step constant-rate run (checkpoints at 6 and 12) with its store, made once."""
    root = tmp_path_factory.mktemp("parent")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("WORKBENCH_CACHE", str(cache_dir))
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        assert main(CONSTANT + ["train.steps=12", "train.run_dir=runs/parent"]) == 0
    return root


@pytest.mark.parametrize("extra, key", [
    (["train.init_from=runs/none"], "train.init_from"),
    (["train.init_from=runs/parent", "model.n_layers=2"], "model.n_layers"),
    (["train.init_from=runs/parent", "model.family=gpt2"], "model.family"),
    (["train.init_from=runs/parent", "train.steps=12"], "train.steps"),
    (["train.init_from=runs/parent", "train.steps=20", "lowrank=adaptive"], "lowrank.mode"),
    (["train.init_from=runs/parent/checkpoints"], "train.init_from"),  # no checkpoint
    (["train.decay_steps=5"], "train.decay_steps"),  # only a wsd schedule decays over steps
    (["train.lr_schedule=wsd", "train.steps=12", "train.decay_steps=10"], "train.decay_steps"),
    (["train.lr_schedule=linear"], "train.lr_schedule"),
])
def test_bad_input_exits_2_with_one_line_and_records_nothing(parent, workdir, capsys, extra,
                                                            key):
    shutil.copytree(parent, workdir, dirs_exist_ok=True)  # runs/parent and its mlflow.db
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(CONSTANT + ["train.run_dir=runs/bad"] + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {key}"), err
    assert not (workdir / "runs/bad").exists() and list(_runs()) == ["parent"]


def test_learned_positions_tie_the_checkpoint_to_its_sequence_length():
    from workbench.compose import compose
    from workbench.errors import ConfigError
    from workbench.job import Job, config_dict
    from workbench.train.branch import InitPoint, check

    parent = compose(["model=gpt2_124m", "train.steps=10"])
    point = InitPoint(Path("step_00000010.pt"), 10, Job(config_dict(parent), "k", "runs/p"))
    check(point, compose(["model=gpt2_124m", "train.steps=20", "model.rope_theta=1"]))
    with pytest.raises(ConfigError, match="seq_len=1024"):
        check(point, compose(["model=gpt2_124m", "train.steps=20", "model.seq_len=2048"]))


def test_an_interrupted_checkpoint_is_not_started_from(workdir, capsys):
    assert main(CONSTANT + ["train.steps=12", "train.run_dir=runs/parent"]) == 0
    (_ckpt("runs/parent", 12) / "complete.json").unlink()  # killed mid-write
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(CONSTANT + ["train.run_dir=runs/bad", "train.steps=20",
                         f"train.init_from={_ckpt('runs/parent', 12)}"])
    assert "writing finished" in capsys.readouterr().err
    # the folder means its newest complete checkpoint: step 6
    assert main(CONSTANT + ["train.run_dir=runs/b", "train.init_from=runs/parent",
                            "train.steps=8"]) == 0
    assert _runs()["b"].data.tags["wb.init_step"] == "6"


def _as_old_whole_files(run_dir: Path, steps) -> None:
    """Rewrite a run's checkpoints as the one-process engine of older versions wrote them:
    checkpoints/step_N.pt (model, optimizer state keyed by position, RNG, step) with a sidecar
    of its size and sha256; the checkpoint folders go."""
    import hashlib
    import io

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from workbench.job import Job
    from workbench.train.model import build
    from workbench.train.optimizer import make_optimizer

    cfg = Job.load(run_dir).run_config()
    for step in steps:
        folder = _ckpt(run_dir, step)
        dcp_to_torch_save(folder, run_dir / "named.pt")
        named = torch.load(run_dir / "named.pt", weights_only=False)
        model = build(cfg.model, cfg.train.seed)
        optimizer = make_optimizer(list(model.parameters()), cfg)
        model.load_state_dict(named["model"])
        set_optimizer_state_dict(model, optimizer, named["optimizer"])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    **torch.load(folder / "extra_rank00000.pt", weights_only=False)}, buf)
        data = buf.getvalue()
        path = run_dir / "checkpoints" / f"step_{step:08d}.pt"
        path.write_bytes(data)
        path.with_suffix(".json").write_text(json.dumps(
            {"step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    (run_dir / "named.pt").unlink()
    shutil.rmtree(folder.parent)


def test_an_old_whole_file_run_is_refused_and_continues_as_a_new_run(workdir, capsys):
    """A run folder of an older version (whole-file checkpoints) is not resumed: one line, exit
    2, naming the way on, `train.init_from`, which converts its checkpoint once into the new
    run's `init/` and repeats the old run's losses from there, bitwise."""
    assert main(CONSTANT + ["train.steps=12", "train.run_dir=runs/old"]) == 0
    old = workdir / "runs/old"
    _as_old_whole_files(old, [6, 12])
    (old / "checkpoints/step_00000012.json").unlink()  # the newest one was cut short
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(CONSTANT + ["train.steps=12", "train.run_dir=runs/old"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after "resuming run in ..."
    assert e.value.code == 2 and err.startswith("error: "), err
    assert "whole-file checkpoints" in err and f"train.init_from={old}" in err, err
    assert main(CONSTANT + ["train.steps=12", "train.run_dir=runs/new",
                            "train.init_from=runs/old"]) == 0
    runs = _runs()
    assert runs["new"].data.tags["wb.init_step"] == "6"
    assert (workdir / "runs/new/init/complete.json").exists()
    assert metric_series(runs["new"].info.run_id, "loss") == \
        metric_series(runs["old"].info.run_id, "loss")[6:]
    assert runs["old"].info.status == "FINISHED"  # the refused resume recorded nothing


README_BLOCK = "python -m workbench.run train.run_dir=runs/stable"


@pytest.mark.slow
def test_the_readme_long_run_block_branches_and_continues_in_another_layout(workdir,
                                                                             monkeypatch):
    """The README's block (test_readme leaves it to this test): a constant-rate run, a wsd
    cool-down off its step-40 checkpoint, and the run continued past its end on 2 FSDP ranks;
    then that run's sharded checkpoint continued in one process."""
    clone = make_clone(workdir)
    block = block_with(README_BLOCK)
    proc = run_block(block, clone)
    assert proc.returncode == 0, f"README {block.id} failed:\n{proc.stderr[-4000:]}"
    monkeypatch.chdir(clone)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{clone / 'mlflow.db'}")
    more = ["train.run_dir=runs/one", "train.lr_schedule=constant", "train.steps=84",
            "train.init_from=runs/stable-more", "train.eval_every=2", "train.warmup_steps=1",
            "train.eval_batches=1", "data.max_bytes=1000000", "train.global_batch=4"]
    assert main(more) == 0
    runs = _runs()
    assert all(r.info.status == "FINISHED" for r in runs.values())
    stable, cool, wider, one = (runs[k].info.run_id for k in ("stable", "cool40", "stable-more",
                                                              "one"))
    assert sorted(p.name for p in (clone / "runs/stable/checkpoints").glob("*/step_*")) == [
        f"step_{s:08d}" for s in (20, 40, 50, 60)]  # keep_every=20, and the newest 2
    # the cool-down: its first forward is on the parent's step-40 weights and batch; its rate
    # decays 1-sqrt to the floor over steps 40..49
    assert metric_series(cool, "loss")[0] == metric_series(stable, "loss")[40]
    lrs = [v for _, v in metric_series(cool, "lr")]
    assert lrs[-1] == pytest.approx(3e-4) and lrs[0] < 3e-3 and sorted(lrs, reverse=True) == lrs
    # 2 FSDP ranks from one process' checkpoint: the same weights (val_loss at step 60)
    assert runs["stable-more"].data.params["world_size"] == "2"
    assert runs["stable-more"].data.tags["wb.parent_run_id"] == stable
    assert metric_series(wider, "val_loss")[0] == (60, pytest.approx(
        metric_series(stable, "val_loss")[-1][1], rel=1e-5))
    # one process from the 2 ranks' sharded checkpoint, at step 80
    assert runs["one"].data.tags["wb.init_step"] == "80"
    assert "dps2" in runs["one"].data.params["train.init_from"]
    assert metric_series(one, "val_loss")[0] == (80, pytest.approx(
        metric_series(wider, "val_loss")[-1][1], rel=1e-5))
    # the block's report tells the branches apart by what differs, and where each started
    rows = json.loads((clone / "reports/branches/summary.json").read_text())
    assert [r["run_id"] for r in rows] == [stable, cool, wider]
    labels = [r["run"] for r in rows]
    assert len(set(labels)) == 3 and "from step 40" in labels[1], labels
    assert "lr_schedule=wsd" in labels[1] and "steps=50" in labels[1], labels
