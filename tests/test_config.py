"""Every config file composes into the typed RunConfig; presets carry published sizes; bad
overrides give one line naming the key, and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.compose import compose
from workbench.config import CONF_DIR, RunConfig
from workbench.errors import ConfigError
from workbench.train.model import build, n_params

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def _options(group: str):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_to_runconfig(group, option):
    prefix = "+" if group == "sweep" else ""
    extra = ["data.path=/some/shards"] if (group, option) == ("data", "tokens") else []
    cfg = compose([f"{prefix}{group}={option}", *extra])
    assert isinstance(cfg, RunConfig)
    if group != "sweep":
        section = getattr(cfg, group)
        assert section is not None
        if hasattr(section, "name") and group not in ("lowrank",):
            assert section.name in (option, section.name)


def test_groups_are_those_of_the_design():
    assert set(GROUPS) >= {"model", "cluster", "layout", "train", "data", "lowrank", "launcher",
                           "tracking", "sweep"}


@pytest.mark.parametrize("option", [o for o in _options("model")])
def test_model_presets_match_published_parameter_counts(option):
    cfg = compose([f"model={option}"]).model
    if cfg.published_params:
        assert abs(n_params(cfg) / cfg.published_params - 1) < 0.01, option
    else:  # our own presets: the arithmetic must equal the real module's count
        model = build(cfg, seed=0)
        assert sum(p.numel() for p in model.parameters()) == n_params(cfg)


def test_gpt_small_is_in_its_size_band():
    assert 10e6 <= n_params(compose(["model=gpt_small"]).model) <= 30e6


def test_tiny_divides_for_every_2_and_4_way_layout():
    m = compose([]).model
    for d in (2, 4):
        assert m.n_heads % d == 0 and m.n_kv_heads % d == 0 and m.n_layers % d == 0


@pytest.mark.parametrize("override,key", [
    ("model=nope", "model"),
    ("model.foo=1", "model.foo"),
    ("model.n_layers=abc", "model.n_layers"),
    ("train.steps=-1", "train.steps"),
    ("model.n_heads=7", "model.n_heads"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("layout=xx", "layout"),
    ("lowrank.mode=sometimes", "lowrank.mode"),
    ("bogus=3", "bogus"),
    ("train.lr=[1", "train.lr"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert str(e.value).startswith(key), str(e.value)
    assert "\n" not in str(e.value)


def test_cli_bad_input_exits_2_with_one_line(workdir: Path):
    from conftest import cli

    out = cli("workbench.run", ["model.n_heads=5"], workdir)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_heads" in lines[0] and "Traceback" not in out.stderr
    assert not (workdir / "mlflow.db").exists()  # nothing recorded for a rejected run


@pytest.mark.parametrize("override,key", [
    ("model.foo=1", "model.foo"),
    ("model.n_layers=abc", "model.n_layers"),
    ("train.steps=-1", "train.steps"),
    ("model.n_heads=7", "model.n_heads"),
    ("lowrank.mode=sometimes", "lowrank.mode"),
])
def test_a_recorded_config_is_checked_like_a_composed_one(tmp_path, capsys, override, key):
    """A job file edited (or written by another version) into a config the command line
    refuses is refused the same way when a rank reads it: one line naming the key and the
    file, exit 2, before anything trains."""
    import json

    from workbench.cli import guarded
    from workbench.job import Job, config_dict
    from workbench.train.__main__ import main as train_main

    recorded = config_dict(compose(["tracking=none"]))
    job = Job(config=recorded, layout="single", run_dir=str(tmp_path))
    assert job.run_config() == compose(["tracking=none"])
    name, value = override.split("=")
    section, field = name.split(".")
    recorded[section][field] = json.loads(value) if value.lstrip("-").isdigit() else value
    path = Job(config=recorded, layout="single", run_dir=str(tmp_path)).save()
    with pytest.raises(ConfigError) as e:
        Job.load(path).run_config()
    assert str(e.value).startswith(f"{key}=") and str(path) in str(e.value), str(e.value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        guarded(train_main)([str(path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith(f"error: {key}=") and "\n" not in err, err


@pytest.mark.parametrize("option", ["gpt_tiny", "gpt_small"])
def test_meta_and_direct_builds_give_bitwise_equal_weights(option, monkeypatch):
    """Small models skip the meta device (its first use costs seconds); both paths must draw
    the same weights, tied embeddings included."""
    import torch

    from workbench.train import model as model_mod

    cfg = compose([f"model={option}"]).model
    direct = model_mod.build(cfg, seed=3)
    monkeypatch.setattr(model_mod, "META_ABOVE_PARAMS", 0)
    via_meta = model_mod.build(cfg, seed=3)
    a, b = direct.state_dict(), via_meta.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if cfg.tie_embeddings:
        assert via_meta.output.weight is via_meta.tok_embeddings.weight
        assert direct.output.weight is direct.tok_embeddings.weight


def test_every_number_past_what_torch_takes_is_named():
    """Each scalar number of every section, set past what torch and numpy take (an integer
    past int64, a NaN or infinite float), is refused naming that key: such a value otherwise
    hangs building the model, overflows in a C call or trains to a NaN loss."""
    import copy
    import dataclasses

    from workbench.config_rules import validate

    base = compose([])
    checked = 0
    for section in dataclasses.fields(base):
        sub = getattr(base, section.name)
        for f in dataclasses.fields(sub) if dataclasses.is_dataclass(sub) else ():
            value = getattr(sub, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            for bad in ((2**64,) if isinstance(value, int) else (float("nan"), float("inf"))):
                cfg = copy.deepcopy(base)
                setattr(getattr(cfg, section.name), f.name, bad)
                with pytest.raises(ConfigError, match=f"{section.name}.{f.name}="):
                    validate(cfg)
                checked += 1
    assert checked > 80
