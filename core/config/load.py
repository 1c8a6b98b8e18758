"""Build the resolved config: schema ← preset (or a checkpoint's saved config) ← ``key=value`` overrides, then
the shapes a checkpoint fixes, derived values and checks.

Every mistake becomes a :class:`ConfigError` whose message names the key and what would be right. The modules
that read checkpoints and Hugging Face directories are imported only when a config names one: they import
torch, which ``ipuft config show`` and every ``--help`` never need.
"""

from __future__ import annotations

import copy
import dataclasses
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ipuft.config.identity import apply_checkpoint_model
from ipuft.config.recipe import PRESET as RECIPE_PRESET
from ipuft.config.recipe import apply_recipe, wants_recipe
from ipuft.config.rules import derive_and_validate, derived_gradient_accumulation
from ipuft.config.safe_yaml import parse_config_mapping, parse_yaml_value, read_config_data
from ipuft.config.schema import Config
from ipuft.config.sections import ConfigSectionRegistry
from ipuft.errors import ConfigError, choices


def preset_names() -> list[str]:
    """The presets shipped with ipuft."""
    root = resources.files("ipuft.presets")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


BASE_KEY = "base"  # a YAML's first key: the preset or file it starts from
_BASE_DEPTH = 8  # presets starting from presets: a deeper chain is a mistake, not a config


def _read_preset(preset: str) -> tuple[str, dict, set[str]]:
    """``(name, data, own)``: the parsed YAML of a shipped preset, or of a ``.yaml`` file the user names by path,
    merged over the presets and files it starts from (its ``base``); ``own``: the keys the user's files set,
    which are their settings (a shipped preset's are a recipe, and a checkpoint's shapes override them)."""
    data, own, _ = _read_chain(preset, None, [])
    return preset, data, own


def _read_chain(spec: str, within: Path | None, chain: list[str]) -> tuple[dict, set[str], bool]:
    """``spec`` (a preset name or a path) read and merged over its own base, and whether it is a shipped preset.
    ``within``: the directory of the file that names ``spec`` as its base, which a base path is relative to and
    may not leave; ``chain``: the files and presets that led here, for cycles."""
    named = f"--config {chain[0].removeprefix('preset ')}: base {spec}" if chain else "--config"
    if spec.endswith((".yaml", ".yml")):
        path = Path(spec)
        if within is not None:
            if path.is_absolute():
                raise ConfigError(f"{named}: a base is a preset name or a path relative to {within}, not an "
                                  f"absolute path")
            path = within / path
            if not path.resolve().is_relative_to(within.resolve()):
                raise ConfigError(f"{named}: the base leaves {within}, the directory of the file naming it; "
                                  f"keep it there or below")
        if not path.exists() and not path.is_symlink():  # anything else not a regular file: read_config_data says
            raise ConfigError(f"{named}: preset file {path} does not exist")
        identity, shipped = str(path.resolve()), False
        data = read_config_data(path, f"{named}: preset {path}")
    else:
        # Only a shipped preset's own name: `base: /etc/passwd` or `../../secret` would otherwise be joined to the
        # presets' directory and read.
        if spec not in preset_names():
            allowed = "a path to a .yaml file" if within is None else f"a .yaml file inside {within}"
            raise ConfigError(f"{named}: unknown preset {spec!r}; presets: {choices(preset_names())} "
                              f"(or {allowed})")
        resource = resources.files("ipuft.presets") / f"{spec}.yaml"
        identity, shipped, path = f"preset {spec}", True, None
        data = parse_config_mapping(resource.read_text(), f"{named}: preset {spec}")
    if identity in chain:
        raise ConfigError(f"{named}: the bases make a cycle ({' -> '.join([*chain, identity])}); remove one")
    if len(chain) >= _BASE_DEPTH:
        raise ConfigError(f"{named}: more than {_BASE_DEPTH} presets start from one another; merge some of them")
    own = set() if shipped else set(_dotted_keys(data)) - {BASE_KEY}
    if BASE_KEY not in data:
        return data, own, shipped
    base = data.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{named}: {BASE_KEY} must name a preset ({choices(preset_names())}) or a .yaml file, "
                          f"got {str(base)[:40]!r}")
    if shipped and base.endswith((".yaml", ".yml")):
        raise ConfigError(f"{named}: a shipped preset's {BASE_KEY} is a preset name, not a file")
    below, below_own, _ = _read_chain(base, None if path is None else path.parent, [*chain, identity])
    return _merged(below, data), below_own | own, shipped


def _merged(below: dict, above: dict) -> dict:
    """``above`` over ``below``: mappings merged key by key, any other value (a list too) replaced."""
    out = dict(below)
    for key, value in above.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _schema(sections: ConfigSectionRegistry | None) -> DictConfig:
    plugin_sections = (sections or ConfigSectionRegistry()).schema_type()
    resolved = dataclasses.make_dataclass(
        "ResolvedConfig",
        [("plugins", plugin_sections, dataclasses.field(default_factory=plugin_sections))],
        bases=(Config,),
    )
    return OmegaConf.structured(resolved)


def _valid_keys(schema: DictConfig, parent: str) -> list[str]:
    node = OmegaConf.select(schema, parent) if parent else schema
    return list(node.keys()) if isinstance(node, DictConfig) else []


# Keys of the reference's PopXL config that have no meaning in ipuft, and why.
REFERENCE_ONLY = {
    "execution.device_iterations": "PopXL runs several steps per host call; ipuft's host drives every step",
    "execution.attention_serialisation": "PopXL splits attention to bound its memory; "
                                         "scaled_dot_product_attention never materialises the T×T scores",
}


def _explain(exc: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    """Turn an OmegaConf error into one line naming the key and what would be right."""
    key = getattr(exc, "full_key", "") or ""
    if key in REFERENCE_ONLY:
        return ConfigError(f"{source}: {key} is a setting of the PopXL reference with no ipuft equivalent "
                           f"({REFERENCE_ONLY[key]}); remove it")
    if isinstance(exc, ConfigKeyError) or "not in struct" in str(exc):
        parent = key.rpartition(".")[0]
        where = f"in {parent}" if parent else "at the top level"
        return ConfigError(f"{source}: unknown config key {key}; valid keys {where}: "
                           f"{', '.join(_valid_keys(schema, parent))}")
    msg = str(getattr(exc, "msg", None) or exc).splitlines()[0]  # a merge error of a whole node has no msg
    return ConfigError(f"{source}: {key or 'config'}: {msg}")


def _parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or any(c.isspace() for c in key):
            raise ConfigError(f"argument {item!r} is not KEY=VALUE (for example training.steps=10)")
        try:
            parsed.append((key, parse_yaml_value(value) if value else None))
        except yaml.YAMLError:
            parsed.append((key, value))
    return parsed


def load_config(
    preset: str | tuple[str, dict] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    sections: ConfigSectionRegistry | None = None,
    default_preset: bool = False,
    notes: list[str] | None = None,
) -> DictConfig:
    """The resolved, validated, read-only config: schema ← preset ← ``key=value`` overrides.

    ``preset`` is a shipped preset's name, a YAML file's path, or ``(name, data)``: a mapping already
    read (a checkpoint's config). A checkpoint's shapes override a shipped preset's (which is a recipe);
    only keys the user typed, in overrides or in a YAML file of theirs, may disagree with the checkpoint.
    ``default_preset``: the user did not choose it (``ipuft train`` with no ``--config``); with a checkpoint
    (``model.hf_checkpoint``, ``model.init_checkpoint``) the run then takes the fine-tuning recipe instead
    (:mod:`ipuft.config.recipe`), and the line that says so is appended to ``notes``.
    """
    parsed = _parse_overrides(list(overrides))
    recipe_for = wants_recipe(parsed) if default_preset else None
    if recipe_for is not None:
        preset = RECIPE_PRESET
    schema = _schema(sections)
    cfg = schema.copy()
    typed: set[str] = set()
    chosen: set[str] = set()  # keys the user set: overrides, and a preset file they named (not a checkpoint's dump)
    if preset is not None:
        if isinstance(preset, str):
            name, data, own = _read_preset(preset)
        else:  # a checkpoint's config: every key of it is the run's
            (name, data), own = preset, set(_dotted_keys(preset[1]))
        if not default_preset:
            typed |= own
            if isinstance(preset, str):
                # A run's config.yaml (or `config show`'s output) holds every installed section at its
                # defaults: only a value other than the default is a setting the file makes.
                chosen |= {key for key in own if not _is_default(schema, data, key)}
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as exc:
            raise _explain(exc, schema, f"preset {name}") from None
        _drop_recorded_gradient_accumulation(cfg, data)
    for key, value in parsed:
        typed.add(key)
        chosen.add(key)
        try:
            if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
                raise ConfigKeyError(f"Key '{key}' is not in struct")
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as exc:
            if not getattr(exc, "full_key", None):
                exc.full_key = key  # type: ignore[attr-defined]
            raise _explain(exc, schema, "override") from None
    given = {key for key, _ in parsed}
    if {"training.epochs", "training.steps"} <= given and cfg.training.epochs is not None:
        raise ConfigError("override: training.epochs and training.steps: give one of them (with training.epochs "
                          "the steps are ceil(epochs × rows / training.global_batch_size))")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc, schema, "config") from None
    if cfg.checkpoint.load == "latest":
        cfg.checkpoint.load = str(latest_of_run(cfg))
    positions = saved = None
    found: list[str] = []  # what reading the checkpoint notes
    if cfg.model.hf_checkpoint is not None:
        from ipuft.io.hf_import import apply_hf_shapes, resolve_hf_directory

        cfg.model.hf_checkpoint = str(resolve_hf_directory(cfg.model.hf_checkpoint))
        positions = apply_hf_shapes(cfg, typed, sections.families if sections is not None else None, found)
    if cfg.model.init_checkpoint is not None:
        saved = apply_checkpoint_model(cfg, typed, sections)
    if recipe_for is not None:
        line = apply_recipe(cfg, typed, recipe_for, positions, saved)
        if notes is not None:
            notes.append(line)
    if notes is not None:
        notes += found
    if default_preset and "data.tokenizer" not in typed and (cfg.model.hf_checkpoint or cfg.model.init_checkpoint):
        cfg.data.tokenizer = None  # the checkpoint's own tokenizer, not the default preset's sample one
    if sections is not None and (unused := sections.unused_settings(cfg, chosen)):
        raise ConfigError(f"{unused[0]}: it is set but does nothing in this config; drop it or select what it "
                          f"configures")
    derive_and_validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


_MISSING = object()


def checkpoint_config(path: str | Path, sections: ConfigSectionRegistry | None,
                      overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a checkpoint (or a run directory's latest) was saved with, set to load that checkpoint
    (``checkpoint.load``), then ``overrides``; ``sections`` are the plugins' config sections.

    The file is untrusted data: it may hold no interpolation (none is ever resolved), and it never
    chooses where the new run writes: ``output_dir`` and ``checkpoint.save`` fall back to their defaults
    unless ``overrides`` set them (:func:`ipuft.config.migrate.migrate`).

    The checkpoint stands alone: its config holds the whole model and its weights are the checkpoint's, so the
    places the run it comes from started from (``model.hf_checkpoint``, ``model.init_checkpoint``, which may
    have moved, gone, or been relative to another working directory) are not read again, and the tokenizer is
    the checkpoint's copy (unless ``overrides`` set ``data.tokenizer``).
    """
    from ipuft.config.migrate import migrate, saved_config_data
    from ipuft.io.checkpoint import find_checkpoint

    found = find_checkpoint(path)
    data = saved_config_data(found)
    migrate(data, sections)
    typed = {o.split("=", 1)[0].strip() for o in overrides}
    model, data_section = data.get("model"), data.get("data")
    if isinstance(model, dict):
        for key in ("hf_checkpoint", "init_checkpoint"):
            if f"model.{key}" not in typed:
                model[key] = None
    if isinstance(data_section, dict) and "data.tokenizer" not in typed and (found / "tokenizer.json").is_file():
        data_section["tokenizer"] = str(found)
    return load_config((str(found / "config.yaml"), data), [f"checkpoint.load={found}", *overrides], sections)


def latest_of_run(cfg: DictConfig) -> Path:
    """``checkpoint.load=latest``: the newest checkpoint of the run ``output_dir`` (or ``checkpoint.save``)."""
    from ipuft.io.checkpoint import DEFAULT_SAVE, checkpoint_root, find_checkpoint

    if cfg.output_dir is None and cfg.checkpoint.save in (None, DEFAULT_SAVE):
        raise ConfigError("checkpoint.load=latest: set output_dir to the run to resume (or checkpoint.save)")
    root = checkpoint_root(cfg, Path(cfg.output_dir or ".")) or Path(cfg.output_dir) / "checkpoints"
    return find_checkpoint(root)


def _is_default(schema: DictConfig, data: dict, key: str) -> bool:
    """Whether dotted ``key``'s value in ``data`` is the schema's default for it."""
    try:
        default = OmegaConf.select(schema, key, default=_MISSING)
        value = data
        for part in key.split("."):
            value = value[part]
    except (OmegaConfBaseException, KeyError, TypeError):  # an odd key: merging the file names it
        return False
    if OmegaConf.is_config(default):
        default = OmegaConf.to_container(default)
    elif isinstance(default, Enum):
        default = default.name
    return default is not _MISSING and type(value) is type(default) and value == default


def _drop_recorded_gradient_accumulation(cfg: DictConfig, data: dict) -> None:
    """A file's ``gradient_accumulation`` that is what its own batch keys derive is a record of them (a run's
    config.yaml, `config show`'s output): dropped, so that it is derived again after the overrides. Any other
    value is left for validation to refuse."""
    recorded = data.get("gradient_accumulation")
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        return
    try:
        derived = derived_gradient_accumulation(cfg)
    except (ArithmeticError, TypeError):  # a zero or missing batch key: validation names it
        return
    if recorded == derived:
        cfg.gradient_accumulation = None


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    """Every leaf key of a nested mapping, dotted: ``{"model": {"layers": 2}}`` → ``["model.layers"]``."""
    keys = []
    for key, value in data.items():
        keys += _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def with_values(cfg: DictConfig, values: dict[str, Any]) -> DictConfig:
    """A read-only copy of the resolved ``cfg`` with the dotted keys of ``values`` set (values the run derives
    once the config is loaded: the layout ``auto`` chose, the steps ``training.epochs`` takes)."""
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    for key, value in values.items():
        OmegaConf.update(out, key, value)
    OmegaConf.set_readonly(out, True)
    return out


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML, as ``ipuft config show`` prints and run directories keep it."""
    return OmegaConf.to_yaml(cfg)
