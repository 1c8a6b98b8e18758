"""YAML read as data: every config file ipuft reads (a preset, a run's or a checkpoint's config.yaml, a
``key=value`` override's value) is parsed here, size-bounded, with PyYAML's safe loader and without aliases,
so that no object is constructed and no file expands beyond its size; and a file that came from a checkpoint
may hold no OmegaConf interpolation, which would be resolved against the reader's environment.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ipuft.errors import CheckpointError, ConfigError
from ipuft.io.files import read_bounded

_PRESET_LIMIT = 1 << 20  # bytes: a config is a few kB; more is not a config


def read_config_data(path: Path, source: str) -> dict:
    """The mapping in YAML file ``path`` (a preset or a checkpoint's config.yaml); ``source`` names it in
    errors. A regular file, size-bounded (:func:`ipuft.io.files.read_bounded`), and parsed with PyYAML's safe
    loader: no object is constructed."""
    data = read_bounded(path, _PRESET_LIMIT, f"{source}: {path}", ConfigError, hint="; a config is a few kB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: {path} cannot be read as UTF-8 text ({type(exc).__name__})") from None
    return parse_config_mapping(text, source)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: a config never needs them, and nested aliases (a "billion
    laughs") expand exponentially once the config is merged."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"YAML aliases (*{event.anchor}) are not allowed in a config")
        return super().compose_node(parent, index)


def parse_yaml_value(text: str):
    """A YAML scalar, list or mapping, parsed safely and without aliases."""
    return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader subclass


def parse_config_mapping(text: str, source: str) -> dict:
    """The mapping of config keys in YAML ``text``; ``source`` names it in the one-line error otherwise."""
    try:
        data = parse_yaml_value(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{source} nests too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a YAML mapping of config keys")
    return data


def refuse_interpolations(data, source: str, key: str = "") -> None:
    """Raise a :class:`CheckpointError` if any string in ``data`` (parsed YAML or JSON) holds an OmegaConf
    interpolation (``${...}``): a file we read is data, and resolving it could read the environment."""
    if isinstance(data, dict):
        for k, v in data.items():
            refuse_interpolations(v, source, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            refuse_interpolations(v, source, f"{key}[{i}]")
    elif isinstance(data, str) and "${" in data:
        raise CheckpointError(f"{source}: {key or 'a value'} holds an interpolation ({data[:40]!r}); files read "
                              f"from checkpoints are data and are never resolved: remove it")
