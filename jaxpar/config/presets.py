"""A Config from a YAML preset and dotted key=value overrides, with model.from_hf's shape filled in.

Pure Python like jaxpar.config: the CLI builds the config before jax starts. Presets in configs/
hold only what differs from the dataclass defaults and may name a preset to extend
(`extends: default.yaml`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxpar.config import Config, ConfigError, apply_overrides, flatten_dict, quoted
from jaxpar.config.from_run import resolve_run
from jaxpar.config.hf_config import resolve
from jaxpar.config.sources import mixture_text


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    """Read a preset, following 'extends: other.yaml' (relative to the preset's folder)."""
    if not path.is_file():
        raise ConfigError(f"config file {quoted(path)} does not exist.")
    if path.resolve() in seen:
        raise ConfigError(f"config file {quoted(path)} extends itself in a loop.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, ValueError, OverflowError) as e:  # ValueError: not UTF-8, or a date like 2020-13-45
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"config file {quoted(path)} is not valid YAML ({first_line}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {quoted(path)} must hold a mapping of sections.")
    parent = data.pop("extends", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(f"'extends' in {quoted(path)} must name another preset file, got {parent!r}.")
    base = _read_yaml(path.parent / parent, seen + (path.resolve(),)) if parent else {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"section {quoted(section)} in {quoted(path)} must be a mapping of keys.")
    return _merge(base, data)


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def _mixture_as_text(tree: dict) -> dict:
    """data.mixture given as a mapping of folders to weights, in its string form: before the tree is
    flattened into keys, where the folders would read as config keys. On the command line the mapping
    is YAML's, `data.mixture='{web: 0.7, code: 0.3}'`."""
    data = tree.get("data")
    if isinstance(data, dict) and isinstance(data.get("mixture"), dict):
        return {**tree, "data": {**data, "mixture": mixture_text(data["mixture"])}}
    value = tree.get("data.mixture")
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = yaml.safe_load(value)
        except (yaml.YAMLError, ValueError, OverflowError):
            raise ConfigError(f"data.mixture {quoted(value)} is not a YAML mapping such as "
                              f"'{{web: 0.7, code: 0.3}}'.") from None
    if isinstance(value, dict):
        return {**tree, "data.mixture": mixture_text(value)}
    return tree


def parse_override(arg: str) -> tuple[str, str]:
    """Split 'train.steps=10' into ('train.steps', '10') with a clear error otherwise."""
    key, sep, value = arg.partition("=")
    if not sep or not key:
        raise ConfigError(f"argument {quoted(arg)} is neither a .yaml file nor a key=value override.")
    return key.strip(), value


def load_config(path: str | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Build a Config from defaults, an optional YAML preset and key=value overrides, with the shape of
    model.from_hf's checkpoint filled in."""
    cfg, given = Config(), set()
    if path is not None:
        preset = _mixture_as_text(_read_yaml(Path(path)))
        cfg, given = apply_overrides(cfg, preset), set(flatten_dict(preset))
    if overrides:
        pairs = _mixture_as_text(dict(map(parse_override, overrides)) if isinstance(overrides, list) else overrides)
        cfg, given = apply_overrides(cfg, pairs), given | set(flatten_dict(pairs))
    return resolve(resolve_run(cfg, given), given)
