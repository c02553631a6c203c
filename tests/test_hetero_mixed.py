"""Pricing any layout a user ran on a mixed cluster: mixed stages (a stage's replicas on two GPU
types), a user's layer split and degrees under `--explain`, stacks over pools, and GPUs the
planner has no datasheet for, described in the cluster file."""

from __future__ import annotations

import numpy as np
import pytest

from workbench.cli import guarded
from workbench.compose import compose
from workbench.errors import ConfigError
from workbench.plan import __main__ as plan_main
from workbench.plan.cost.coefficients import coefficients
from workbench.plan.cost.columns import Recompute, Schedule, columns
from workbench.plan.cost.hardware import GpuSpec, hardware_for
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.stacks import software_for, stack_software
from workbench.plan.pools.cluster import pool_links, pools_of
from workbench.plan.pools.costs import pool_costs
from workbench.plan.pools.explain import explain_pools
from workbench.plan.pools.pipeline import LinkArrays
from workbench.plan.pools.placement import Members, fill, format_members, parse_placement
from workbench.plan.pools.search import price, rank_pools

L40S = ["model=llama3_8b", "cluster=h100_l40s_pools", "train.global_batch=48"]


def _one_line_exit_2(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        guarded(plan_main.main)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


def test_placement_text_round_trips_and_bad_text_names_the_option() -> None:
    pools = ["h100", "l40s"]
    p = parse_placement("h100:20 | h100*1+l40s*2:6x2", pools, 3)
    assert [(s.members, s.layers) for s in p.stages] == [
        ((("h100", 3),), 20), ((("h100", 1), ("l40s", 2)), 6), ((("h100", 1), ("l40s", 2)), 6)]
    assert p.text() == "h100:20 | h100*1+l40s*2:6x2" and p.replicas_on("l40s") == 4
    even = parse_placement("h100 | l40s+h100", pools, 4)
    assert even.layers is None and even.stages[1].members == (("l40s", 2), ("h100", 2))
    assert even.text() == "h100 | l40s+h100"
    for bad in ("h100+l40s", "a100:8", "h100+h100:8", "h100*1+l40s*1:8", "h100:8 | l40s",
                "h100:eight", ""):
        with pytest.raises(ConfigError) as e:
            parse_placement(bad, pools, 3)
        assert e.value.key == "--stages", bad
    # the search's fill: 4 + 2 replica slots in 3-replica stages, the second one mixed
    assert fill([(0, 4), (1, 2)], 3) == [((0, 3),), ((0, 1), (1, 2))]
    assert fill([(1, 2), (0, 4)], 2) == [((1, 2),), ((0, 2),), ((0, 2),)]


def _layout_overrides(r, i: int) -> list[str]:
    """The run overrides of ranking row i's degrees and split (what a user would have run)."""
    b = int(r.base_idx[i])
    a, layers = r.base, [s.layers for s in r.placement(i).stages]
    rc = ("none", "selective", "full", "selective_op")[int(a["rc"][b])]
    return [f"layout.tp={int(a['tp'][b])}", f"layout.dp_replicate={int(a['dpr'][b])}",
            f"layout.pp={len(layers)}", f"layout.sequence_parallel={bool(a['sp'][b])}",
            f"layout.recompute={rc}", f"layout.stage_layers=[{','.join(map(str, layers))}]",
            f"train.micro_batch={int(a['mb'][b])}"]


def test_explain_of_a_users_split_with_a_mixed_stage_adds_up_to_the_ranking(capsys) -> None:
    """A run's own layout (`--explain layout`, its layout.* overrides and a --stages text
    without layer counts) with a mixed stage: its step time and every pool's memory per stage
    are the ranking's figures for that placement; a split the ranking does not hold still adds
    up (stage times to the step, memory parts to each member's total) to what pricing gives."""
    cfg = compose(L40S)
    r = rank_pools(cfg.model, cfg.cluster, cfg.train)
    i = next(int(i) for i in r.order if r.mixed(int(i)) and len(r.placement(int(i)).stages) > 1)
    place = r.placement(i)
    where = " | ".join(format_members(s.members) for s in place.stages)
    user = compose(L40S + _layout_overrides(r, i))
    x = explain_pools(user.model, user.cluster, user.train, "layout", where,
                      layout_cfg=user.layout)
    assert x.rank == list(r.order).index(i) + 1 and x.stages_text == r.stages(i)
    assert x.split_from == "layout.stage_layers" and x.reason == ""
    assert x.step_time_s == pytest.approx(float(r.step_time_s[i]), rel=1e-12)
    assert x.pipeline_s + x.tail_s == pytest.approx(x.step_time_s, rel=1e-12)
    for j, s in enumerate(x.stages):
        for k, m in enumerate(s.members):
            assert m.peak_bytes == pytest.approx(r.out["stage_mem_bytes"][i, j, k], rel=1e-12)
    mixed = next(s for s in x.stages if len(s.members) > 1)
    assert {m.pool for m in mixed.members} == {"h100", "l40s"}
    assert mixed.time_s == max(m.layers_s + m.other_s for m in mixed.members)

    # the user moves a layer from the first stage to the last: not a ranked placement
    layers = [s.layers for s in place.stages]
    moved = [layers[0] - 1, *layers[1:-1], layers[-1] + 1]
    y = explain_pools(cfg.model, cfg.cluster, cfg.train, x.key,
                      " | ".join(f"{format_members(s.members)}:{n}"
                                 for s, n in zip(place.stages, moved)))
    assert [s.layers for s in y.stages] == moved and y.split_from == "--stages"
    assert y.pipeline_s + y.tail_s == pytest.approx(y.step_time_s, rel=1e-12)
    names = [p.name for p in r.pools]
    p = price(model_shape(cfg.model), r.pools, LinkArrays.of(r.pools, pool_links(
        cfg.cluster, r.pools)), software_for(cfg.train, cfg.cluster), r.base,
        r.base_idx[i:i + 1], Members.of([[[(names.index(q), n) for q, n in s.members]
                                          for s in place.stages]]), np.array([moved]))
    assert y.step_time_s == pytest.approx(float(p.out["step_time_s"][0]), rel=1e-12)
    assert [m.peak_bytes for s in y.stages for m in s.members] == pytest.approx(
        [v for v in p.out["stage_mem_bytes"][0].ravel() if v > 0], rel=1e-12)

    # the command: the same figures, a column per pool; a bad request is one line, exit 2
    args = L40S + _layout_overrides(r, i) + ["--explain", "layout", "--stages", where]
    assert plan_main.main(args) == 0
    out = capsys.readouterr().out
    assert f"on {r.stages(i)}" in out and f"= {x.step_time_s:.4f} s" in out
    both = next(s.members for s in place.stages if s.mixed)
    assert f"layers on {'+'.join(f'{q} x{n}' for q, n in both)}; its replicas step" in out
    lay = _layout_overrides(r, i)
    for argv, key in (  # one stage for layout.pp stages; a pool the cluster lacks
            (L40S + lay + ["--explain", "layout", "--stages", "h100"], "--stages"),
            (L40S + lay + ["--explain", "layout", "--stages", where.replace("l40s", "b200")],
             "--stages"),
            (L40S + lay + ["layout.pp_schedule=gpipe", "--explain", "layout", "--stages", where],
             "layout.pp_schedule"),
            (L40S + lay + ["--explain", "layout"], "--stages"),  # which pools: not said
            (L40S + [a for a in lay if "stage_layers" not in a]
             + ["layout.stage_layers=[1,2]", "--explain", "layout", "--stages", where],
             "layout.stage_layers")):
        assert _one_line_exit_2(argv, capsys).startswith(f"error: {key}"), argv
    # more replicas on a pool than it has GPUs
    many = L40S + ["--explain", "tp2_dp3_mb1_sp", "--stages", "l40s:16x2"]
    assert "pool l40s has 4 GPUs" in _one_line_exit_2(many, capsys)


@pytest.mark.parametrize("tp,dp,mb,sp", [(1, 2, 1, 0), (2, 3, 1, 1), (1, 4, 2, 0), (2, 6, 1, 0)])
def test_a_mixed_stage_is_never_cheaper_than_its_slowest_pool_alone(tp, dp, mb, sp) -> None:
    """The same pipeline with one stage's replicas on h100 and l40s, or all on one pool: the
    mixed stage steps at its slowest replica's pace and its all-reduce crosses the link, so
    neither its time per micro-batch nor the step is below either pool's alone."""
    cfg = compose(L40S)
    pools = pools_of(cfg.cluster)
    links = LinkArrays.of(pools, pool_links(cfg.cluster, pools))
    base = columns(dpr=dp, dps=1, tp=tp, pp=1, cp=1, sp=sp, mb=mb, rc=Recompute.FULL,
                   sched=Schedule.ONE_F_ONE_B, v=1, ga=48 / (dp * mb))
    ms, sw = model_shape(cfg.model), software_for(cfg.train, cfg.cluster)
    one = dp // 2 if dp > 2 else 1
    for pos in range(3):
        mixed = [[(0, dp)], [(1, dp)], [(0, dp)]]
        mixed[pos] = [(0, one), (1, dp - one)]
        alone = [[[(p, dp)] if j == pos else m for j, m in enumerate(mixed)] for p in (0, 1)]
        p = price(ms, pools, links, sw, base, np.zeros(3, dtype=np.int64),
                  Members.of([mixed, *alone]), np.array([[10, 12, 10]] * 3))
        t, step_s = p.out["stage_s"], p.out["step_time_s"]
        assert t[0, pos] >= max(t[1, pos], t[2, pos]) * (1 - 1e-12), (pos, t[:, pos])
        assert step_s[0] >= max(step_s[1], step_s[2]) * (1 - 1e-12)


def test_the_search_puts_a_mixed_stage_first_where_it_is_best() -> None:
    """H100s in a partition of 12 and one of 4 (nodes of 4): at global batch 32 a 16-GPU
    layout needs 4 replicas of tp 2 a stage, and the 12 GPUs hold 6 replicas: the second
    stage straddles the partitions. That beats every layout without a mixed stage."""
    cfg = compose(["model=llama3_8b", "cluster=h100_a100_pools", "train.global_batch=32",
                   "cluster.pools.0.nodes=3", "cluster.pools.0.gpus_per_node=4",
                   "cluster.pools.1.name=spare", "cluster.pools.1.gpu=H100-SXM-80GB",
                   "cluster.pools.1.nodes=1", "cluster.pools.1.gpus_per_node=4",
                   "cluster.links=[{pools:[h100,spare],gbps:12.5}]"])
    r = rank_pools(cfg.model, cfg.cluster, cfg.train)
    top = int(r.order[0])
    assert r.mixed(top) and r.gpus(top) == 16, r.stages(top)
    pure = next(int(i) for i in r.order if not r.mixed(int(i)))
    assert r.step_time_s[pure] > 1.05 * r.step_time_s[top]
    assert "+" in r.stages(top) and r.layers[top].sum() == cfg.model.n_layers


def test_a_gpu_the_planner_does_not_know_is_priced_from_its_figures(capsys) -> None:
    cfg = compose(L40S)
    h100, l40s = pools_of(cfg.cluster)
    assert l40s.spec == GpuSpec("L40S", 3.62e14, 7.33e14, 9.16e13, 4.8e10, 8.64e11, 32.0, 6.25,
                                gpus_per_node=4, sm_count=142)
    # its FP8 peak is 2.02x its BF16 one: the FP8 speedups (of H100's 2x) scale with it
    assert l40s.coeff.fp8_mm_speedup == pytest.approx(1.4 * 7.33e14 / 3.62e14 / 2)
    assert h100.coeff.fp8_mm_speedup == 1.4
    # the figures are what prices it: half the memory bandwidth, slower layers
    slow = compose(L40S + ["cluster.pools.1.hbm_bw_bytes_per_s=4.32e11"])
    base = columns(dpr=1, dps=1, tp=1, pp=1, cp=1, sp=0, mb=1, rc=0, sched=1, v=1, ga=48)
    ms, sw = model_shape(cfg.model), software_for(cfg.train, cfg.cluster)
    assert pool_costs(ms, pools_of(slow.cluster)[1], sw, base).layer_s[0] > \
        pool_costs(ms, l40s, sw, base).layer_s[0]
    # a missing figure: one line naming it and what it is, exit 2
    err = _one_line_exit_2(L40S + ["cluster.pools.1.hbm_bytes=0", "--top", "1"], capsys)
    assert err.startswith("error: cluster.pools[1].hbm_bytes=") and "memory per device" in err
    err = _one_line_exit_2(L40S + ["cluster.pools.1.gpus_per_node=0"], capsys)
    assert err.startswith("error: cluster.pools[1].gpus_per_node=")
    # a single-pool cluster of an unknown GPU: its own FP8 peak and SM count are used
    one = compose(["cluster=local_gpu", "cluster.gpu=MyAccel", "cluster.sm_count=100",
                   "cluster.peak_fp8_flops=2.0e15"]).cluster
    spec = hardware_for(one)
    assert (spec.sm_count, spec.peak_fp8_flops) == (100, 2.0e15)
    assert coefficients(one).fp8_mm_speedup == pytest.approx(1.4 * 2.0e15 / 9.89e14 / 2)
    err = _one_line_exit_2(["model=llama3_8b", "cluster=local_gpu", "cluster.gpu=MyAccel",
                            "cluster.hbm_bytes=???"], capsys)
    assert err.startswith("error: cluster.hbm_bytes=")


def test_a_stack_prices_every_pool_with_its_software(tmp_path, capsys) -> None:
    """`--stack megatron` on a mixed cluster: each member pool's layer time and state are the
    pool's costs under Megatron-Core's Software (the distributed optimizer shards the optimizer
    state over the 3 replicas; TP overlap hides part of SP's collectives), not this engine's."""
    cfg = compose(L40S)
    where = "h100:24 | h100*1+l40s*2:8"
    base = columns(dpr=3, dps=1, tp=2, pp=1, cp=1, sp=1, mb=1, rc=0, sched=1, v=1, ga=16)
    ms = model_shape(cfg.model)
    pools = pools_of(cfg.cluster)
    figures = {}
    for stack in ("workbench", "megatron"):
        sw = stack_software(stack, cfg.train, cfg.cluster)
        x = explain_pools(cfg.model, cfg.cluster, cfg.train, "tp2_dp3_mb1_sp", where,
                          software=sw)
        for m in x.stages[1].members:
            c = pool_costs(ms, next(p for p in pools if p.name == m.pool), sw, base)
            assert m.layers_s == pytest.approx(8 * c.layer_s[0], rel=1e-12)
            assert m.memory_bytes["layer weights, gradients, optimizer"] == pytest.approx(
                8 * c.layer_state_bytes[0], rel=1e-12)
        figures[stack] = x
    mw, mm = (figures[s].stages[1].members[1] for s in ("workbench", "megatron"))
    assert mm.memory_bytes["layer weights, gradients, optimizer"] < \
        mw.memory_bytes["layer weights, gradients, optimizer"]
    assert mm.layers_s < mw.layers_s
    assert figures["megatron"].step_time_s != figures["workbench"].step_time_s
    # FP8 where both GPUs have it (the L40S's from its figures): faster linears
    assert plan_main.main(L40S + ["--stack", "megatron", "--fp8", "--explain",
                                  "tp2_dp3_mb1_sp", "--stages", where]) == 0
    out = capsys.readouterr().out
    fp8 = float(out.split(" = ")[-1].split()[0])
    assert "stack megatron (fp8)" in out and fp8 < figures["megatron"].step_time_s
    assert plan_main.main(L40S + ["--stack", "torchtitan", "--top", "2", "--out",
                                  str(tmp_path / "rank.csv")]) == 0
    assert "stack torchtitan (bf16)" in capsys.readouterr().out
