"""Composition of the run config from the config groups plus overrides, checked into a typed
`RunConfig`: every error is a ConfigError naming the key. A config rebuilt from what a run or
sweep recorded goes through the same check (`from_recorded`), so the code never runs a recorded
config it would refuse on the command line.

Hydra's compose API is used instead of @hydra.main so that the working folder, logging and exit
codes stay ours (a run writes mlflow.db where the user stands, and exit 2 means bad input).
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from typing import Any, List, Mapping, Sequence, Type, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from workbench import conf_search
from workbench.config import CONF_DIR, RunConfig, register
from workbench.config_rules import validate
from workbench.errors import ConfigError

T = TypeVar("T")


def compose_dict(overrides: Sequence[str]) -> DictConfig:
    """Hydra-compose conf/config.yaml with the overrides; schema errors become ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException

    register()
    conf_search.check_all()
    _parse_each(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config",
                           overrides=list(overrides) + conf_search.searchpath_override())
    except MissingConfigException as e:
        raise _missing_option(e, overrides) from None
    except yaml.YAMLError as e:  # a config file (a hand-edited cluster file, say) is not YAML
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}:{mark.line + 1}" if mark else "a config file"
        raise ConfigError(where, "", f"not valid YAML: {getattr(e, 'problem', None) or e}"
                          ) from None
    except (ConfigCompositionException, HydraException, OmegaConfBaseException,
            ValueError) as e:
        err = _hydra_error(e)
        given = {ov.lstrip("+~").split("=", 1)[0]: ov.split("=", 1)[-1] for ov in overrides}
        if err.key in given and err.value in ("", None):
            err = ConfigError(err.key, given[err.key], err.valid)
        raise err from None


def _parse_each(overrides: Sequence[str]) -> None:
    """Parse overrides one by one, so a syntax error names the override that has it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for ov in overrides:
        key, sep, value = ov.partition("=")
        name = key.lstrip("+~")
        if sep and not name:
            raise ConfigError(ov, "", "no key before '='")
        if sep and "." not in name and conf_search.is_group(name):
            valid = conf_search.options(name)  # also refuses an option defined twice
            if value not in valid:
                raise ConfigError(name, value, f"no such option; valid: {', '.join(valid)}")
        try:
            parser.parse_override(ov)
        except HydraException as e:
            key, sep, value = ov.partition("=")
            if not sep:
                raise ConfigError(ov, "", "not key=value (use +key=value to add a key, "
                                  "group=option to pick an option)") from None
            raise ConfigError(key.lstrip("+~"), value,
                              f"cannot parse the value ({_first_line(str(e))})") from None


def to_run_config(cfg: DictConfig, source: str = "") -> RunConfig:
    """The typed config (a RunConfig instance), validated across fields. `source` names where a
    recorded config was read, so its error says which file or run holds the bad value."""
    try:
        return _checked(cfg)
    except ConfigError as e:
        raise _located_in(e, source) from None


def _checked(cfg: DictConfig) -> RunConfig:
    _reject_unknown_keys(cfg)
    try:
        run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except MissingMandatoryValue as e:
        raise ConfigError(str(getattr(e, "full_key", "config")), "???",
                          "required value is missing; pick a preset for its group") from None
    except OmegaConfBaseException as e:
        raise _hydra_error(e) from None
    validate(run)
    return run


def recorded_dict(data: Mapping[str, Any] | str, source: str) -> DictConfig:
    """Recorded plain data (or its YAML text) laid over the schema: a DictConfig typed like a
    composed one, which trial parameters update the same way. A key newer than the record reads
    as its schema default; a key the schema no longer has, or a value of the wrong type, is a
    ConfigError naming the key and `source`."""
    return typed_dict(RunConfig, data, source)


def from_recorded(data: Mapping[str, Any] | str, source: str) -> RunConfig:
    """The one way a RunConfig is rebuilt from recorded data (a job file's resolved config, a
    manifest's config_yaml, a sweep's stored base config, an MLflow run's params): checked
    exactly like a composed one, so what a rank trains, a rerun repeats or a calibration reads
    is a config the command line would have accepted."""
    return to_run_config(recorded_dict(data, source), source)


def typed_dict(schema: type, data: Mapping[str, Any] | str, source: str) -> DictConfig:
    """`data` over the structured `schema` (a RunConfig or one of its sections)."""
    try:
        raw = OmegaConf.create(data) if isinstance(data, str) else data
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"not YAML ({_first_line(str(e))})") from None
    except OmegaConfBaseException as e:
        raise _located_in(_hydra_error(e), source) from None
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), raw)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise _located_in(_hydra_error(e), source) from None


def typed(schema: Type[T], data: Mapping[str, Any] | str, source: str) -> T:
    """One section of a config (a cluster or model YAML outside Hydra) as its dataclass; the
    rules across sections need a whole RunConfig (`from_recorded`)."""
    merged = typed_dict(schema, data, source)
    try:
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise _located_in(_hydra_error(e), source) from None


def _located_in(e: ConfigError, source: str) -> ConfigError:
    return ConfigError(e.key, e.value, f"{e.valid} (in {source})") if source else e


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """`+key=value` bypasses the schema's struct flag; a key the schema lacks is still a typo."""
    def walk(node: DictConfig, schema, prefix: str) -> None:
        known = {f.name: f for f in fields(schema)}
        for key in node.keys():
            full = f"{prefix}{key}"
            if key not in known:
                raise ConfigError(full, node.get(key), "unknown key; valid keys: "
                                  + ", ".join(f"{prefix}{k}" for k in known))
            sub = getattr(schema(), key) if isinstance(schema, type) else getattr(schema, key)
            if is_dataclass(sub) and isinstance(node.get(key), DictConfig):
                walk(node.get(key), type(sub), full + ".")

    walk(cfg, RunConfig, "")


def compose(overrides: Sequence[str]) -> RunConfig:
    return to_run_config(compose_dict(overrides))


def _options(group: str) -> List[str]:
    return conf_search.options(group) if conf_search.is_group(group) else []


def _missing_option(e: Exception, overrides: Sequence[str]) -> ConfigError:
    msg = str(e)
    m = re.search(r"Could not find '([\w/]+)/([^']+)'", msg) or \
        re.search(r"In '[^']*': Could not find '([\w/]+)/([^']+)'", msg)
    if m:
        group, option = m.group(1), m.group(2)
        return ConfigError(group, option, f"no such option; valid: {', '.join(_options(group))}")
    for ov in overrides:
        key = ov.lstrip("+~").split("=")[0]
        if "." not in key and conf_search.is_group(key):
            return ConfigError(key, ov.split("=", 1)[-1],
                               f"valid: {', '.join(_options(key))}")
    return ConfigError("config", "", _first_line(msg))


def _first_line(msg: str) -> str:
    return " ".join(msg.strip().split("\n")[0].split())


def _hydra_error(e: Exception) -> ConfigError:
    """Translate the many Hydra/OmegaConf failures into key + reason."""
    cause = e
    while getattr(cause, "__cause__", None) is not None:
        cause = cause.__cause__  # type: ignore[assignment]
    for err in (cause, e):
        key = getattr(err, "full_key", None)
        if key:
            reason = _first_line(str(err).split("full_key:")[0])
            if "not in '" in reason or "not in struct" in reason:
                reason = f"unknown key; valid keys: {_valid_keys(str(key))}"
            return ConfigError(str(key), getattr(err, "value", ""), reason)
    msg = _first_line(str(e))
    m = re.search(r"Could not override '([^']+)'", str(e))
    if m:
        detail = _first_line(str(cause)) if cause is not e else msg
        key = m.group(1)
        if "Key '" in detail and ("not in struct" in detail or "not in '" in detail):
            detail = f"unknown key; valid keys: {_valid_keys(key)}"
        return ConfigError(key, "", detail)
    m = re.search(r"Error parsing override '([^']+)'", str(e))
    if m:
        return ConfigError(m.group(1).split("=")[0], m.group(1),
                           "cannot parse; use key=value, +key=value for new keys")
    m = re.search(r"Key '([^']+)' is not in struct", msg)
    if m:
        return ConfigError(m.group(1), "", "unknown key")
    return ConfigError("override", "", msg)


def _valid_keys(key: str) -> str:
    section = key.lstrip("+").split(".")[0]
    schema = {f.name: f.type for f in fields(RunConfig)}
    if section == "sweep":
        return "those of workbench.sweep.space.SweepConfig; a new key needs +sweep.KEY=VALUE"
    if section in schema and "." in key and is_dataclass(getattr(RunConfig(), section)):
        sub = getattr(RunConfig(), section)
        return ", ".join(f"{section}.{f.name}" for f in fields(sub))
    return ", ".join(schema)


