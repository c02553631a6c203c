"""Uneven pipeline stages in the layout, the rules, the cost model and the planner (the engine's
loss parity is tests/test_uneven_stages_ranks.py).

The planner holds a split as first / last / fullest-middle layer counts; for identical layers the
family it scores reaches the optimum of the general dynamic program over layers
(workbench.plan.search.splits.balance_stages), which these tests check on a grid of head costs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from test_plan_rules import rule_of

from workbench.compose import compose
from workbench.errors import ConfigError
from workbench.layout import Layout, resolve
from workbench.plan.cost.columns import Schedule, layout_fields, split_from_ends
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.stacks import stack_software
from workbench.plan.search.exhaustive import REASONS, best_layout, rank_layouts, reasons
from workbench.plan.search.rules import validate_layout
from workbench.plan.search.space import enumerate_space
from workbench.plan.search.splits import balance_stages, candidate_ends

LLAMA3 = (7,) + (8,) * 14 + (7,)  # Llama 3 405B on 16 stages (the herd paper, section 3.3.2)


def test_key_round_trip_and_the_even_key_is_unchanged() -> None:
    lay = Layout(dp_replicate=128, tp=8, pp=16, micro_batch=1, grad_accum=16, stage_layers=LLAMA3)
    assert lay.key().endswith("_1f1b-v1_sl7-8x14-7")
    assert Layout.from_key(lay.key()) == lay
    inter = Layout(pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b", grad_accum=4,
                   stage_layers=(0, 2, 1, 1))
    assert Layout.from_key(inter.key()) == inter and inter.key().endswith("_sl0-2-1x2")
    even = Layout(pp=2, grad_accum=4)
    assert "_sl" not in even.key() and Layout.from_key(even.key()) == even
    assert even.stage_split(4) == (2, 2) and inter.stage_split(4) == (0, 2, 1, 1)
    assert lay.as_params()["layout.stage_layers"] == "7-8x14-7"


def test_stage_layers_from_the_config_and_what_is_rejected() -> None:
    cfg = compose(["model=gpt_tiny", "layout=pp", "layout.stage_layers=[3,1]",
                   "train.global_batch=8", "train.micro_batch=2"])
    lay = resolve(cfg.layout, cfg.train, 2)
    assert lay.stage_layers == (3, 1)
    validate_layout(lay, cfg.model, 2)
    bad = {(3, 2): "sums to 5; needs model.n_layers=4", (4,): "has 1 entries; needs "
           "pp*virtual_stages=2", (1, 0, 3): "has 3", (-1, 5): ">= 0 layers on the first"}
    for layers, text in bad.items():
        with pytest.raises(ConfigError) as e:
            validate_layout(Layout(pp=2, grad_accum=4, stage_layers=layers), cfg.model, 2)
        assert e.value.key == "layout.stage_layers" and text in e.value.valid, e.value
    with pytest.raises(ConfigError) as e:  # a middle stage without layers
        validate_layout(Layout(pp=4, grad_accum=4, stage_layers=(2, 0, 1, 1)), cfg.model, 4)
    assert "and >= 1 on every other" in e.value.valid
    with pytest.raises(ConfigError) as e:  # uneven without a list: the divisibility rule
        validate_layout(Layout(pp=3, grad_accum=3), cfg.model, 3)
    assert e.value.key == "layout.pp" and "or give layout.stage_layers" in e.value.valid
    validate_layout(Layout(pp=3, grad_accum=3, stage_layers=(1, 2, 1)), cfg.model, 3)


def test_the_first_last_family_reaches_the_dynamic_programs_optimum() -> None:
    """Identical layers of unit time, the head and loss e_l layer times on the last stage, the
    embedding e_f on the first: the best split of the planner's candidates is as fast as the
    DP's optimum over every contiguous split (the planner rounds e_l to r; the DP sees it)."""
    cases = 0
    for n_layers in (4, 7, 12, 32, 80, 126):
        for n_stages in (2, 3, 4, 5, 8, 16):
            if n_stages - 2 > n_layers:
                continue
            for e_l in (0.0, 0.3, 0.6, 1.2, 1.7, 2.4, 3.5, 6.0):
                for e_f in (0.0, 0.05):
                    _, optimum = balance_stages([1.0] * n_layers, n_stages, first_extra_s=e_f,
                                                last_extra_s=e_l)
                    best = math.inf
                    for first, last in candidate_ends(n_layers, n_stages, e_l):
                        split = split_from_ends(n_layers, n_stages, first, last) if first >= 0 \
                            else (n_layers // n_stages,) * n_stages
                        best = min(best, max(split[0] + e_f, *split[1:-1], split[-1] + e_l))
                    assert best == pytest.approx(optimum), (n_layers, n_stages, e_l, e_f)
                    cases += 1
    assert cases > 500


def test_the_dynamic_program_balances_time_under_memory() -> None:
    """12 unit layers on 4 stages, the head 2 layer times on the last: the optimum is 4 with at
    most 2 layers on the last stage. With activations of 1 byte per layer and micro-batch, 4-1
    micro-batches in flight on stages 0-3 (1F1B) and 8 bytes per stage, the first two stages
    hold at most 2 layers, the third 4: the best split is then 6 (2, 2, 4, 4)."""
    split, t = balance_stages([1.0] * 12, 4, last_extra_s=2.0)
    assert t == pytest.approx(4.0) and sum(split) == 12 and split[-1] <= 2
    split, t = balance_stages([1.0] * 12, 4, last_extra_s=2.0, layer_act_bytes=[1.0] * 12,
                              inflight=[4, 3, 2, 1], budget_bytes=8.0)
    assert split == (2, 2, 4, 4) and t == pytest.approx(6.0)
    # per-layer weights count once, whatever the micro-batches in flight
    assert balance_stages([1.0] * 12, 4, layer_bytes=[1.0] * 12, budget_bytes=2.0) == \
        ((), math.inf)
    assert balance_stages([1.0] * 12, 4, layer_bytes=[1.0] * 12, budget_bytes=3.0)[0] == \
        (3, 3, 3, 3)


def test_a_list_is_scored_by_its_fullest_stage() -> None:
    """A user's list outside the planner's family: [1, 4, 2, 1] runs at the pace of its 4-layer
    stage, as [0, 4, 4, 0] does, and slower than the even split."""
    c = compose(["model=llama3_8b", "model.n_layers=8", "cluster=h100_8x_ib", "train.dtype=bf16"])

    def est(layers: tuple[int, ...]):
        return estimate(c.model, c.cluster, c.train,
                        Layout(pp=4, micro_batch=1, grad_accum=8, stage_layers=layers))

    odd, ends, even = est((1, 4, 2, 1)), est((0, 4, 4, 0)), est(())
    for k in ("time_fwd_s", "time_bwd_s", "time_pp_bubble_s"):
        assert odd.time_s[k] == pytest.approx(ends.time_s[k]), k
    assert odd.step_time_s > even.step_time_s


@pytest.mark.parametrize("world", [8, 16])
def test_validate_and_the_ranking_agree_on_uneven_splits(world: int) -> None:
    """The planner's split rows (with a whole grad_accum) pass validate_layout exactly where the
    ranking finds no broken rule (engine-only rules aside), as for the even ones."""
    rng = random.Random(world)
    for name in ("llama3_8b", "gpt_tiny"):
        model = compose([f"model={name}", "model.n_layers=7"]).model
        a = enumerate_space(world, model)
        a["ga"] = 64 / (a["dpr"] * a["dps"] * a["mb"])
        code = reasons(model, world, a)
        rows = np.flatnonzero((a["lf"] >= 0) & (a["ga"] >= 1) & (a["ga"] == np.floor(a["ga"])))
        assert len(rows)
        for i in rng.sample(list(rows), min(300, len(rows))):
            lay = Layout(**layout_fields(a, i))
            assert sum(lay.stage_layers) == 7 and len(lay.stage_layers) == lay.pp * \
                lay.virtual_stages
            try:
                validate_layout(lay, model, world)
            except ConfigError as err:
                rule = rule_of(err, model, world, lay)
                assert rule.engine or REASONS[code[i]] == rule.name, (lay.key(), err)
            else:
                assert code[i] == 0, (lay.key(), REASONS[code[i]])


def test_layout_auto_picks_an_uneven_split_when_the_head_is_heavy() -> None:
    """8 layers of Llama 3 8B under a 512k vocabulary on 512 H100 with a global batch of 64:
    model parallelism is needed, a pipeline wins, and its last stage (head and loss) gets fewer
    layers; the model predicts it faster than the even split of the same layout (by 5.6%)."""
    c = compose(["model=llama3_8b", "model.n_layers=8", "model.vocab=512000",
                 "cluster=h100_8x_ib", "train.dtype=bf16", "train.global_batch=64"])
    lay = best_layout(c.model, c.cluster, c.train, 512)
    assert lay.pp > 1 and lay.stage_layers, lay.key()
    assert lay.stage_layers[-1] < lay.stage_layers[0], lay.key()
    even = Layout(**{**lay.__dict__, "stage_layers": ()})
    assert estimate(c.model, c.cluster, c.train, lay).step_time_s < \
        estimate(c.model, c.cluster, c.train, even).step_time_s


def test_optuna_search_proposes_the_uneven_split_too() -> None:
    """The sweep's Optuna search scores each pipeline's degrees with the planner's split
    candidates (not sampled). 6 layers under a 256k vocabulary: the exhaustive planner's best
    runs 8 pipeline stages (pp 2 x 4 virtual) that no even split fills, the first holding only
    the embedding and the last only the head; Optuna proposes such uneven pipelines at every
    seed. Its 60-trial best is 3.8-5.4% slower than the exhaustive one (seeds 0-4; the tp 8 x
    cp 2 corner the exhaustive search finds is one TPE rarely samples), hence 6%."""
    from workbench.plan.search.optuna_search import optuna_search

    c = compose(["model=llama3_8b", "model.n_layers=6", "model.vocab=256000",
                 "cluster=h100_8x_ib", "train.dtype=bf16", "train.global_batch=32"])
    best = best_layout(c.model, c.cluster, c.train, 512)
    assert best.stage_layers and best.pp * best.virtual_stages > 6, best.key()
    best_s = estimate(c.model, c.cluster, c.train, best).step_time_s
    for seed in range(5):
        found = optuna_search(c.model, c.cluster, c.train, 512, n_trials=60, seed=seed).layout
        assert found is not None and found.pp > 1 and found.stage_layers, found
        assert estimate(c.model, c.cluster, c.train, found).step_time_s <= 1.06 * best_s

@pytest.fixture(scope="module")
def llama3_405b():
    c = compose(["model=llama3_405b", "cluster=h100_8x_ib", "cluster.nodes=2048",
                 "train.global_batch=2048", "train.dtype=bf16"])
    return c, rank_layouts(c.model, c.cluster, c.train, 16384)


def test_llama3_405b_pipelines_with_uneven_stages_are_ranked(llama3_405b) -> None:
    """126 layers: the divisibility rule now rejects only stage counts with no split at all
    (more than 128 stages); uneven pipelines, interleaved ones too, are feasible and ranked."""
    c, r = llama3_405b
    a = r.arrays
    divisible = r.rejected().get("pp*virtual_stages must divide n_layers", 0)
    assert divisible < 218_250
    blamed = r.reason == REASONS.index("pp*virtual_stages must divide n_layers")
    assert (a["pp"][blamed] * a["v"][blamed] > 128).all()
    top = [r.layout(int(i)) for i in r.order[:20]]
    assert any(lay.pp > 1 and lay.stage_layers for lay in top), [x.key() for x in top]
    for i, lay in zip(r.order[:20], top):  # a split row and its Layout are the same layout
        assert Layout.from_key(lay.key()) == lay
        e = estimate(c.model, c.cluster, c.train, lay)
        assert e.step_time_s == pytest.approx(float(r.step_time_s[i]), rel=1e-9)
        assert e.peak_mem_bytes == pytest.approx(float(r.peak_mem_bytes[i]), rel=1e-9)
    feasible = r.order
    inter = feasible[(a["sched"][feasible] == Schedule.INTERLEAVED_1F1B) & (a["lf"][feasible] >= 0)]
    assert len(inter) > 0


def test_llama3_405b_own_layout_is_expressed_and_its_split_wins(llama3_405b) -> None:
    """tp 8 x pp 16 x dp 128 with 7 + 14 x 8 + 7 layers: valid, in the ranked space, and no
    other split of those degrees is faster; (8, ..., 6) ties in time but holds more on the
    first rank."""
    c, r = llama3_405b
    lay = Layout(dp_replicate=128, tp=8, pp=16, sequence_parallel=True, micro_batch=1,
                 grad_accum=16, stage_layers=LLAMA3)
    validate_layout(lay, c.model, 16384)
    a = r.arrays
    same = np.flatnonzero((a["tp"] == 8) & (a["pp"] == 16) & (a["dpr"] == 128) & (a["sp"] == 1)
                          & (a["mb"] == 1) & (a["rc"] == 0) & (a["sched"] == Schedule.ONE_F_ONE_B))
    splits = {(int(a["lf"][i]), int(a["ll"][i])): i for i in same}
    assert (7, 7) in splits and len(splits) > 1
    ours = splits[(7, 7)]
    assert r.layout(int(ours)) == lay
    for other, i in splits.items():
        assert r.step_time_s[ours] <= r.step_time_s[i] * (1 + 1e-12), other
    if (8, 6) in splits:
        assert r.peak_mem_bytes[ours] < r.peak_mem_bytes[splits[(8, 6)]]


def test_the_bubble_is_the_other_stages_fill_and_drain() -> None:
    """A 1F1B step takes ga micro-batches of the slowest stage plus one of every other (fill
    and drain): the unlike stages of workbench.plan.pools.pipeline, and (pp - 1) of the slowest
    for stages alike."""
    cfg = compose(["model=llama3_8b", "cluster=h100_8x_ib"])
    model, cluster, train = cfg.model, cfg.cluster, cfg.train

    def terms(layers: tuple) -> dict:
        lay = Layout(pp=2, tp=8, micro_batch=1, grad_accum=8, stage_layers=layers)
        return estimate(model, cluster, train, lay).time_s

    even, heavy = terms(()), terms((28, 4))
    # stages alike up to the embedding and the head: close to one slowest micro-batch
    assert even["time_pp_bubble_s"] < even["time_pp_p2p_s"] + even["time_fwd_s"] / 8 \
        + even["time_bwd_s"] / 8 + even["time_tp_comm_s"] / 8
    # 28 layers and 4: the drain is the light stage's micro-batch, about 4/28 of the heavy one
    heavy_mb = (heavy["time_fwd_s"] + heavy["time_bwd_s"] + heavy["time_tp_comm_s"]) / 8
    assert 0.1 < heavy["time_pp_bubble_s"] / heavy_mb < 0.3


def test_this_engines_pipeline_sends_run_beside_its_compute() -> None:
    """torch.distributed.pipelining's sends are asynchronous: with compute to hide behind, a
    step pays one micro-batch's transfers however many micro-batches it runs; Megatron-Core's
    batched sends are waited for every micro-batch."""
    cfg = compose(["model=gpt_tiny", "cluster=local_cpu"])
    pays = {ga: estimate(cfg.model, cfg.cluster, cfg.train,
                         Layout(pp=2, micro_batch=4, grad_accum=ga)).time_s["time_pp_p2p_s"]
            for ga in (2, 8)}
    assert pays[2] == pytest.approx(pays[8]) and pays[2] > 0
    megatron = stack_software("megatron", cfg.train, cfg.cluster)
    mega = {ga: estimate(cfg.model, cfg.cluster, cfg.train,
                         Layout(pp=2, micro_batch=4, grad_accum=ga), software=megatron
                         ).time_s["time_pp_p2p_s"] for ga in (2, 8)}
    assert mega[8] == pytest.approx(4 * mega[2])
