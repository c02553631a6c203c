"""Exhaustive ranking, best_layout for layout=auto, and the seeded Optuna search."""

from __future__ import annotations

import pytest

from workbench.compose import compose
from workbench.errors import ConfigError
from workbench.plan.cost.estimate import estimate
from workbench.plan.search.exhaustive import best_layout, rank_layouts
from workbench.plan.search.optuna_search import optuna_search
from workbench.plan.search.rules import engine_only, validate_layout

# Issue target: >= 9/10 seeds within 2% (the measured figure is in the README's planner table).
MIN_HITS = 9


def cfg(model: str, gb: int, cluster: str = "h100_8x_ib"):
    return compose([f"model={model}", f"cluster={cluster}", f"train.global_batch={gb}",
                    "train.dtype=bf16"])


def test_ranking_is_sorted_feasible_and_matches_estimate() -> None:
    c = cfg("llama3_8b", 64)
    r = rank_layouts(c.model, c.cluster, c.train, 16)
    assert len(r.order) > 0 and r.rejected()
    tok = r.tokens_per_s[r.order]
    assert (tok[:-1] >= tok[1:]).all()
    for i in r.order[:5]:
        lay = r.layout(int(i))
        try:
            validate_layout(lay, c.model, 16)
        except ConfigError as err:  # engine limits (even pipeline stages ...) are not cost rules
            assert engine_only(err), err
        e = estimate(c.model, c.cluster, c.train, lay)
        assert e.fits
        assert e.tokens_per_s == pytest.approx(float(r.tokens_per_s[i]), rel=1e-9)


def test_best_layout_world_size_and_error() -> None:
    c = cfg("llama3_8b", 32)
    lay = best_layout(c.model, c.cluster, c.train, 8)
    assert lay.world_size == 8 and lay.global_batch == 32
    big = cfg("llama3_405b", 1)
    with pytest.raises(ConfigError) as e:
        best_layout(big.model, big.cluster, big.train, 1)
    assert e.value.key == "layout" and e.value.value == "auto"


def test_layout_auto_leaves_the_memory_margin_free() -> None:
    """layout.mem_margin_gib: layout=auto takes the fastest layout predicted to leave that much
    free, passing over faster ones that fill memory tighter; a margin nothing leaves is the run's
    one-line error, naming the margin."""
    from workbench.submit import choose_layout

    c = compose(["launcher=local"])
    r = rank_layouts(c.model, c.cluster, c.train, 1)
    head = [(r.hbm_bytes - r.peak_mem_bytes[i]) / 2**30 for i in r.order]
    assert head[0] < max(head)  # the fastest is not the roomiest: a margin can move the choice
    margin = (head[0] + max(head)) / 2
    c.layout.auto, c.layout.mem_margin_gib = True, margin
    lay = choose_layout(c, 1)
    want = next(int(i) for i, h in zip(r.order, head) if h >= margin)
    assert lay.key() == r.layout(want).key() and lay.key() != r.layout(int(r.order[0])).key()
    c.layout.mem_margin_gib = max(head) + 1
    with pytest.raises(ConfigError) as e:
        choose_layout(c, 1)
    assert "leaves less than the memory margin free" in str(e.value)


def test_layout_auto_skips_what_only_other_stacks_run() -> None:
    """GPT-3's vocabulary (50257) admits no tensor parallelism here and its tied embeddings no
    pipeline: the cost model's favourite (tp x pp, as Megatron runs it) is passed over for the
    fastest layout this engine accepts."""
    c = cfg("gpt3_175b", 1024)
    r = rank_layouts(c.model, c.cluster, c.train, 512)
    top = r.layout(int(r.order[0]))
    assert top.tp > 1 or top.pp > 1
    lay = best_layout(c.model, c.cluster, c.train, 512)
    validate_layout(lay, c.model, 512)
    assert lay.tp == 1 and lay.pp == 1


def test_optuna_within_two_percent_of_exhaustive_for_most_seeds() -> None:
    """Seeds 0-9, 100 trials each (infeasible ones count), no trial seeded from the ranking."""
    c = cfg("llama3_70b", 512)
    r = rank_layouts(c.model, c.cluster, c.train, 256)
    best = float(r.tokens_per_s[r.order[0]])
    hits = 0
    for seed in range(10):
        res = optuna_search(c.model, c.cluster, c.train, 256, n_trials=100, seed=seed)
        assert res.layout is not None and len(res.study.trials) == 100
        assert res.tokens_per_s <= best * (1 + 1e-9)
        infeasible = [t for t in res.study.trials if "infeasible" in t.user_attrs]
        assert len(infeasible) == res.n_infeasible
        hits += res.tokens_per_s >= 0.98 * best
    assert hits >= MIN_HITS, f"{hits}/10 seeds within 2%"


def test_row_keys_are_the_layouts_own_keys() -> None:
    """The CSV writes 1.3 million keys for a 405B ranking from the columns directly; each must be
    the string Layout.key() gives (uneven splits, interleaving, sequence parallel included)."""
    import numpy as np

    from workbench.plan.cost.columns import row_keys

    cfg = compose(["model=llama3_405b", "cluster=h100_8x_ib", "train.global_batch=2048",
                   "train.dtype=bf16"])
    r = rank_layouts(cfg.model, cfg.cluster, cfg.train, 16384)
    rows = np.flatnonzero(r.arrays["ga"] >= 1)
    sample = np.random.default_rng(0).choice(rows, 3000, replace=False)
    assert row_keys(r.arrays, sample) == [r.layout(int(i)).key() for i in sample]
    kinds = [r.layout(int(i)) for i in sample]
    assert any(x.stage_layers for x in kinds) and any(x.sequence_parallel for x in kinds)
    assert any(x.pp_schedule == "interleaved_1f1b" for x in kinds)
