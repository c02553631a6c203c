"""Planning over pools of different GPUs: config, stage costs, the layer split, the search, the
command, and the accuracy claim on AMP's published mixed-cluster sweep."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import benchmark_module

from workbench.cli import guarded
from workbench.compose import compose
from workbench.errors import ConfigError
from workbench.layout import Layout
from workbench.plan import __main__ as plan_main
from workbench.plan.cost.columns import layout_columns
from workbench.plan.cost.estimate import estimate
from workbench.plan.cost.shapes import model_shape
from workbench.plan.cost.stacks import software_for
from workbench.plan.pools.cluster import pools_of
from workbench.plan.pools.costs import pool_costs
from workbench.plan.pools.pipeline import LinkArrays, Stages, balance, build, step
from workbench.plan.pools.placement import Members
from workbench.plan.pools.search import rank_pools

POOLS = ["model=llama3_8b", "cluster=h100_a100_pools", "train.global_batch=64"]


def test_a_cluster_without_pools_is_one_pool_of_its_own_fields() -> None:
    cfg = compose(["cluster=a100_80g_8x_ib", "cluster.nodes=2"])
    (pool,) = pools_of(cfg.cluster)
    assert (pool.gpus, pool.spec.peak_bf16_flops, pool.spec.hbm_bytes) == (16, 3.12e14,
                                                                            8.5899e10)


def test_pools_take_datasheet_figures_and_reject_bad_links() -> None:
    cfg = compose(POOLS)
    h100, a100 = pools_of(cfg.cluster)
    assert (h100.gpus, a100.gpus) == (8, 16)
    assert a100.spec.peak_bf16_flops == 312e12 and a100.coeff.mm_eff_max == 0.80
    v100, t4 = pools_of(compose(["cluster=v100_t4_pools"]).cluster)
    assert (v100.gpus, t4.gpus, t4.spec.hbm_bw_bytes_per_s) == (12, 4, 0.32e12)
    for bad, key in ((["cluster.links=[{pools:[h100,b200],gbps:1}]"], "cluster.links[0].pools"),
                     (["cluster.links=[{pools:[h100,a100],gbps:0}]"], "cluster.links[0]"),
                     (["cluster.pools.1.gpu=Z9000"], "cluster.pools[1].gpu")):
        with pytest.raises(ConfigError) as e:
            pools_of(compose(POOLS + bad).cluster)
        assert e.value.key == key


@pytest.mark.parametrize("tp,dp,pp,split", [(2, 2, 2, (16, 16)), (1, 2, 4, (8, 8, 8, 8)),
                                            (2, 4, 1, (32,)), (1, 1, 8, (4,) * 8)])
def test_one_pool_stage_costs_agree_with_the_cost_model(tp, dp, pp, split) -> None:
    """Stages built from the cost model's evaluate per pool give its own memory exactly and its
    step time within 6% (the DP overlap and the end transfers are approximated linearly)."""
    cfg = compose(["model=llama3_8b", "cluster=h100_8x_ib", "train.dtype=bf16",
                   "train.global_batch=32"])
    lay = Layout(dp_replicate=dp, tp=tp, pp=pp, micro_batch=1, grad_accum=32 // dp,
                 stage_layers=split, recompute="full")
    est = estimate(cfg.model, cfg.cluster, cfg.train, lay)
    a = layout_columns([lay])
    costs = pool_costs(model_shape(cfg.model), pools_of(cfg.cluster)[0],
                       software_for(cfg.train, cfg.cluster), a)
    st = build([costs], Members.single(np.zeros((1, pp), dtype=np.int64)),
               np.zeros(1, dtype=np.int64), a["ga"], LinkArrays(np.ones((1, 1)), np.zeros((1, 1))))
    out = step(st, np.array([split], dtype=float), a["ga"])
    assert out["stage_mem_bytes"].max() == pytest.approx(est.peak_mem_bytes, rel=1e-6)
    assert out["step_time_s"][0] == pytest.approx(est.step_time_s, rel=0.06)


def test_balance_is_the_best_split_under_memory() -> None:
    """Against every split of 9 layers over 4 stages of different speeds and memory."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        c, e = rng.uniform(1, 3, 4), rng.uniform(0, 2, 4)
        u, w, hbm = rng.uniform(1, 2, 4), rng.uniform(0, 1, 4), rng.uniform(3, 8, 4)
        st = Stages(on=np.ones((1, 4), bool), mon=np.ones((1, 4, 1), bool), c=c[None, :, None],
                    e=e[None, :, None], u=u[None, :, None], w=w[None, :, None],
                    q=np.zeros((1, 4, 1)), r=np.zeros((1, 4, 1)), hbm=hbm[None, :, None],
                    lo=np.array([[0.0, 1.0, 1.0, 0.0]]))
        n, ok = balance(st, 9)
        times = [max(np.array(k) * c + e) for k in itertools.product(range(10), repeat=4)
                 if sum(k) == 9 and all(np.array(k) >= st.lo[0])
                 and all(np.array(k) * u + w <= hbm)]
        assert bool(ok[0]) == bool(times)
        if times:
            assert sum(n[0]) == 9 and all(n[0] * u + w <= hbm)
            assert max(n[0] * c + e) == pytest.approx(min(times))


def test_search_places_stages_on_pools_and_answers_the_fast_pool_question() -> None:
    cfg = compose(POOLS)
    r = rank_pools(cfg.model, cfg.cluster, cfg.train)
    top = int(r.order[0])
    assert len(r.uses(top)) == 2  # the 1.5 TB/s of A100s beat leaving them idle here
    assert r.layers[top].sum() == cfg.model.n_layers
    one = r.best_single_pool()
    assert one is not None and r.uses(one) in (("h100",), ("a100",))
    assert r.step_time_s[one] > r.step_time_s[top]
    # a link too slow to cross: the best layout keeps to one pool
    slow = compose(POOLS + ["cluster.links.0.gbps=0.0001"])
    rs = rank_pools(slow.model, slow.cluster, slow.train)
    assert len(rs.uses(int(rs.order[0]))) == 1


def test_a_margin_keeps_every_stage_that_much_below_its_gpus_memory() -> None:
    """rank_pools under `--margin-gib`: the split balances within HBM less the margin, so a
    layout feasible only by filling a pool's memory drops out, and no survivor eats the margin."""
    from workbench.plan.cost.hardware import GIB

    cfg = compose(POOLS)
    r0 = rank_pools(cfg.model, cfg.cluster, cfg.train)
    r8 = rank_pools(cfg.model, cfg.cluster, cfg.train, margin_bytes=8 * GIB)
    assert 0 < len(r8.order) < len(r0.order)
    assert set(r8.order) < set(r0.order)
    assert r8.mem_frac[r8.order].max() <= 1.0  # a share of HBM less the margin
    # a dropped layout filled some stage past its HBM less the margin under the old split (else
    # that split would still be feasible)
    hbm = [p.spec.hbm_bytes for p in r8.pools]
    dropped = [int(i) for i in r0.order if i not in set(r8.order)]
    assert min(r0.mem_frac[dropped]) > min(1 - 8 * GIB / h for h in hbm)


def test_explain_on_pools_itemizes_each_stage_and_adds_up(capsys) -> None:
    """--explain on a mixed cluster: each stage's memory parts sum to the fullest-stage share the
    ranking printed, the stage times to its step time; --stages picks another placement of the
    key, and a key or placement the ranking never printed is one line, exit 2."""
    from workbench.plan.pools.explain import explain_pools

    cfg = compose(POOLS)
    r = rank_pools(cfg.model, cfg.cluster, cfg.train)
    top, second = int(r.order[0]), int(r.order[1])
    x = explain_pools(cfg.model, cfg.cluster, cfg.train, r.key(top))
    assert x.rank == 1 and x.stages_text == r.stages(top)
    assert [s.layers for s in x.stages] == [s.layers for s in r.placement(top).stages]
    members = [m for s in x.stages for m in s.members]
    assert max(m.peak_bytes / m.hbm_bytes for m in members) == pytest.approx(r.mem_frac[top])
    assert all(v >= 0 for m in members for v in m.memory_bytes.values())
    assert x.pipeline_s + x.tail_s == pytest.approx(x.step_time_s, rel=1e-12)
    assert x.step_time_s == pytest.approx(float(r.step_time_s[top]), rel=1e-12)
    same = [i for i in r.order if r.key(int(i)) == r.key(second)]
    pick = r.stages(int(same[-1]))
    y = explain_pools(cfg.model, cfg.cluster, cfg.train, r.key(second), pick.replace(" ", ""))
    assert y.stages_text == pick and y.rank == list(r.order).index(same[-1]) + 1
    assert plan_main.main(POOLS + ["--explain", r.key(top)]) == 0
    out = capsys.readouterr().out
    assert f"layout {r.key(top)} on {r.stages(top)}" in out and "stage 1:" in out
    for bad in (["--explain", "tp9"], ["--explain", r.key(top), "--stages", "h100:1"],
                ["--stages", "h100:1"]):
        with pytest.raises(SystemExit) as e:
            guarded(plan_main.main)(POOLS + bad)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --"), bad


def test_plan_command_prints_stage_pools_and_the_single_pool_best(tmp_path, capsys) -> None:
    out = tmp_path / "rank.csv"
    assert plan_main.main(POOLS + ["--out", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "h100:" in text and "a100:" in text and "best single-pool layout" in text
    assert out.read_text().splitlines()[0].startswith("rank,layout,stages")
    with pytest.raises(SystemExit) as e:
        guarded(plan_main.main)(POOLS + ["cluster.links=[{pools:[h100,x],gbps:1}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "cluster.links[0].pools" in err[0]


def test_beats_amps_cost_model_on_its_mixed_cluster_sweep() -> None:
    mod = benchmark_module("hetero_accuracy")
    import csv

    with mod.DATA.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["sweep"] == "het_cluster"]
    s = mod.score(rows, mod.NODES["het_cluster"])
    assert s["ran"] == 43 and s["rho_amp"] == pytest.approx(0.394, abs=1e-3)
    assert s["rho_ours"] > s["rho_amp"] and s["regret_ours"] <= 0.05
