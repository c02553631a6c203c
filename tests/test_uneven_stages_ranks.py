"""Uneven pipeline stages on real gloo ranks (`layout.stage_layers`): per-step losses, gradient
norms and the final val_loss equal the single-process run (1e-5 relative), with stages that hold
different numbers of layers, including a first stage with only the embedding and a last one with
only the head. gpt_tiny has 4 layers; each world's cases share one spawned process group."""

from __future__ import annotations

from typing import Dict, List

import pytest
from test_parallel import assert_matches_single_process, make_case, reference

from workbench.data.corpus import load as load_data
from workbench.testing.multirank import run_cases

STEPS = ["train.steps=2"]
LAYOUTS_2: Dict[str, List[str]] = {
    "pp2_1f1b_3_1": ["layout=pp", "layout.stage_layers=[3,1]"],
    # global stages 0..3 on ranks 0,1,0,1: rank 0 holds the embedding alone, then layers 2
    "pp2_interleaved_0_2_1_1": ["layout=pp", "layout.pp_schedule=interleaved_1f1b",
                                "layout.virtual_stages=2", "layout.stage_layers=[0,2,1,1]"],
}
LAYOUTS_4: Dict[str, List[str]] = {
    "pp4_1f1b_2_1_1_0": ["layout=pp", "layout.stage_layers=[2,1,1,0]"],
    "pp2_dp2_gpipe_1_3": ["layout.pp=2", "layout.dp_shard=2", "layout.pp_schedule=gpipe",
                          "layout.stage_layers=[1,3]"],
}


def test_cases_really_are_uneven(tmp_path) -> None:
    """The layouts under test resolve to the lists asked for (not silently to the even split)."""
    for world, cases in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        for name, overrides in cases.items():
            case = make_case(name, world, overrides + STEPS, tmp_path)
            assert case.layout.stage_layers and len(set(case.layout.stage_layers)) > 1, name
            assert case.layout.stage_split(4) == case.layout.stage_layers
            assert "_sl" in case.layout.key()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("uneven_ref"), STEPS)


def _run(world: int, layouts: Dict[str, List[str]], root) -> Dict[str, Dict]:
    """All cases in one spawned group; each rank reports the parameter names it holds."""
    cases = [make_case(name, world, overrides + STEPS, root, fingerprint=True)
             for name, overrides in layouts.items()]
    for case in cases:
        case.ckpt_dir = ""
    results = run_cases(world, cases, load_data(cases[0].cfg.data), str(root / "ranks"),
                        timeout_s=300)
    return {c.name: {**r, "layout": c.layout} for c, r in zip(cases, results)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(2, LAYOUTS_2, tmp_path_factory.mktemp("uneven2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run(4, LAYOUTS_4, tmp_path_factory.mktemp("uneven4"))


def assert_ranks_hold_their_layers(result: Dict) -> None:
    """Pipeline rank r holds exactly the layers of global stages r, r + pp, ... of the list."""
    lay = result["layout"]
    bounds = [sum(lay.stage_layers[:s]) for s in range(len(lay.stage_layers) + 1)]
    held = [sorted({int(k.split(".")[1]) for k in r["weights"] if k.startswith("layers.")})
            for r in result["ranks"]]
    for rank, layers in enumerate(held):
        pp_rank = rank // (len(held) // lay.pp)  # pp is the outermost mesh dimension
        want = sorted(i for s in range(pp_rank, len(bounds) - 1, lay.pp)
                      for i in range(bounds[s], bounds[s + 1]))
        assert layers == want, (rank, layers, want)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_ranks_uneven_stages_match_single_process(two_ranks, ref, name):
    assert_matches_single_process(two_ranks[name], ref)
    assert_ranks_hold_their_layers(two_ranks[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_ranks_uneven_stages_match_single_process(four_ranks, ref, name):
    assert_matches_single_process(four_ranks[name], ref)
    assert_ranks_hold_their_layers(four_ranks[name])


def test_uneven_pipeline_resumes_from_its_checkpoint(tmp_path):
    """A pipeline killed after its step-2 checkpoint resumes and repeats steps 2-3 exactly (the
    requeue of a pooled Slurm job runs this path). DCP saves a param group's non-tensor values
    from rank 0 only; the last stage's optimizer must keep its own betas."""
    from test_parallel import make_case

    over = ["layout=pp", "layout.stage_layers=[3,1]", "train.steps=4", "train.ckpt_every=2"]
    cases = [make_case("whole", 2, over, tmp_path),
             make_case("resumed", 2, over, tmp_path, "whole", keep_up_to_step=2)]
    whole, resumed = run_cases(2, cases, load_data(cases[0].cfg.data), str(tmp_path / "ranks"),
                               timeout_s=300)
    assert "error" not in resumed, resumed.get("traceback")
    assert [h["step"] for h in resumed["history"]] == [2, 3]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"][2:]]
