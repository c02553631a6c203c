"""The feasibility rules are written once (workbench/plan/search/rules.py): validate_layout, the
exhaustive ranking's rejections, layout=auto and the Optuna space all agree on every layout."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from workbench.compose import compose
from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.layout import Layout
from workbench.plan.cost.columns import layout_fields
from workbench.plan.search.exhaustive import REASONS, reasons
from workbench.plan.search.optuna_search import _space, optuna_search
from workbench.plan.search.rules import RULES, validate_layout
from workbench.plan.search.space import divisors, enumerate_space

ODD = ModelConfig(name="odd", family="gpt2", n_layers=6, hidden=48, n_heads=12, n_kv_heads=12,
                  ffn_hidden=192, vocab=300, seq_len=24, tie_embeddings=True, bias=True)


def models() -> list[ModelConfig]:
    named = [compose([f"model={m}"]).model for m in ("llama3_8b", "gpt3_175b", "gpt_tiny")]
    return named + [ODD]


def rule_of(err: ConfigError, model: ModelConfig, world: int, lay: Layout):
    """The rule that raised `err` (by key and message)."""
    found = [r for r in RULES
             if r.key == err.key and r.message(model, world, lay) == err.valid]
    assert found, err
    return found[0]


@pytest.mark.parametrize("world", [8, 12, 16, 24])
def test_validate_and_the_ranking_reject_the_same_layouts(world: int) -> None:
    """Rows of the planner's space with a whole grad_accum: validate_layout passes exactly where
    the ranking finds no broken rule and no engine rule applies, and a rule that validate names
    (not an engine one) is the one the ranking counts the layout under."""
    rng = random.Random(world)
    for model in models():
        for gb in (8, 48, 96):
            a = enumerate_space(world)
            a["ga"] = gb / (a["dpr"] * a["dps"] * a["mb"])
            code = reasons(model, world, a)
            whole = np.flatnonzero((a["ga"] >= 1) & (a["ga"] == np.floor(a["ga"])))
            for i in rng.sample(list(whole), min(400, len(whole))):
                lay = Layout(**layout_fields(a, i))
                try:
                    validate_layout(lay, model, world)
                except ConfigError as err:
                    rule = rule_of(err, model, world, lay)
                    if rule.engine:
                        continue  # the cost model ranks it; layout=auto passes it over
                    assert REASONS[code[i]] == rule.name, (lay.key(), err)
                else:
                    assert code[i] == 0, (model.name, lay.key(), REASONS[code[i]])


def test_validate_raises_the_first_rule_with_its_message() -> None:
    m = ODD
    cases = [(Layout(tp=0), "layout.tp", "must be >= 1"),
             (Layout(recompute="some"), "layout.recompute", "must be one of"),
             (Layout(tp=2), "layout", "!= world size 1"),
             (Layout(tp=5, dp_shard=1), "layout", "= 5 != world size 1")]
    for lay, key, text in cases:
        with pytest.raises(ConfigError) as e:
            validate_layout(lay, m, 1)
        assert e.value.key == key and text in e.value.valid, e.value
    with pytest.raises(ConfigError) as e:
        validate_layout(Layout(cp=5), m, 5)
    assert e.value.key == "layout.cp" and "must divide model.seq_len=24" in e.value.valid
    with pytest.raises(ConfigError) as e:
        validate_layout(Layout(tp=8), m, 8)
    assert e.value.key == "layout.tp" and e.value.valid == "must divide model.n_heads=12"
    validate_layout(Layout(tp=2, dp_shard=2), compose(["model=llama3_8b"]).model, 4)


@pytest.mark.parametrize("world", [8, 12, 16])
def test_optuna_space_is_what_the_rules_allow(world: int) -> None:
    """A degree is in Optuna's space exactly when that degree alone (everything else 1, GPipe)
    passes validate_layout; cp is capped at 32 by the search. Engine rules do not shrink the
    space (the cost model ranks such layouts), so validate runs on the model without what
    triggers them (tied embeddings, a vocabulary tp may not divide)."""
    for model in models():
        free = dataclasses.replace(model, tie_embeddings=False, vocab=model.vocab * world)
        space = _space(model, world)
        assert space == _space(free, world)
        for name, values in (("tp", space.tp), ("pp", space.pp), ("cp", space.cp)):
            allowed = []
            for d in divisors(world):
                try:
                    validate_layout(Layout(**{name: d}, pp_schedule="gpipe"), free, d)
                except ConfigError:
                    continue
                if name != "cp" or d <= 32:
                    allowed.append(d)
            assert values == allowed, (model.name, name)


def test_optuna_feasible_trials_pass_the_ranking_rules() -> None:
    c = compose(["model=llama3_8b", "cluster=h100_8x_ib", "train.global_batch=64",
                 "train.dtype=bf16"])
    res = optuna_search(c.model, c.cluster, c.train, 16, n_trials=25, seed=3)
    keys = [t.user_attrs["layout"] for t in res.study.trials if "layout" in t.user_attrs]
    assert keys
    for key in keys:
        lay = Layout.from_key(key)
        try:
            validate_layout(lay, c.model, 16)
        except ConfigError as err:
            assert rule_of(err, c.model, 16, lay).engine, (key, err)
