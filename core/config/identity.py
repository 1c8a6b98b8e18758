"""A model's identity: the config keys that make a model what it is, which its checkpoint's weights fix.

They are ``model.family`` and the components (:data:`COMPONENT_KEYS`), the shapes core's schema holds for
every model (:data:`CORE_SHAPES`), the keys the model's family names (:attr:`ModelFamily.model_keys`, such
as ``plugins.llama.kv_heads``) and those of the config sections of the components in use
(:meth:`ConfigSectionRegistry.add`'s ``model_keys``). Nothing here is one family's: a model of any family
a plugin registers starts from a checkpoint of a run (``model.init_checkpoint``) or resumes one with the
whole of its identity.

Besides, a checkpoint says which tokens its model begins and ends text with (:data:`CARRIED`): a new run
takes them from it unless the user sets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ipuft.config.sections import ConfigSectionRegistry
from ipuft.errors import CheckpointError, ConfigError

COMPONENT_KEYS = ("model.family", "model.embeddings", "model.decoder", "model.head", "model.adapter")
# The model's shapes and settings in core's schema, which every component reads.
CORE_SHAPES = (
    "model.layers", "model.hidden_size", "model.intermediate_size", "model.embedding.vocab_size",
    "model.attention.heads", "model.attention.rotary_dim", "model.attention.rotary_positional_embeddings_base",
    "model.layer_norm_epsilon", "model.tie_embeddings",
)  # fmt: skip
# What a checkpoint says of its tokens, which a new run takes unless the user sets it.
CARRIED = ("model.bos_token_id", "model.eos_token_ids")

_ABSENT = object()


def model_keys(cfg: DictConfig, sections: ConfigSectionRegistry | None) -> list[str]:
    """The dotted keys of the model ``cfg`` selects (its family and components), in a stable order."""
    keys = [*COMPONENT_KEYS, *CORE_SHAPES]
    families = sections.families if sections is not None else None
    if families is not None and cfg.model.family in families:
        keys += families.get(cfg.model.family).model_keys
    for name in sections or ():
        when = sections.used_when(name)
        if all(str(OmegaConf.select(cfg, key)) == value for key, value in when.items()):
            keys += [f"plugins.{name}.{field}" for field in sections.model_keys(name)]
    return list(dict.fromkeys(keys))


def saved_lookup(saved: dict, key: str) -> Any:
    """The value of dotted ``key`` in a parsed config mapping (``None`` where it is null), or :data:`_ABSENT`
    where any part of it is missing: a null setting (no rope scaling) is a value a checkpoint fixes."""
    node: Any = saved
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def plain(value: Any) -> Any:
    """A config value as parsed YAML holds it: containers as dicts and lists, enums by name."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, enum_to_str=True)
    return value.name if isinstance(value, Enum) else value


def differences(saved: dict, cfg: DictConfig, keys: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, cfg's value)`` for each of ``keys`` that saved config ``saved`` holds with
    another value than ``cfg``."""
    found = []
    for key in keys:
        value, mine = saved_lookup(saved, key), plain(OmegaConf.select(cfg, key, default=None))
        if value is not _ABSENT and value != mine:
            found.append((key, value, mine))
    return found


def _typed(key: str, typed: set[str]) -> bool:
    """Whether the user set ``key``, or a key inside it or around it."""
    return any(t == key or t.startswith(f"{key}.") or key.startswith(f"{t}.") for t in typed)


def apply_checkpoint_model(cfg: DictConfig, typed: set[str], sections: ConfigSectionRegistry | None) -> dict:
    """Take the model from ``model.init_checkpoint``'s saved config, as a Hugging Face checkpoint's comes from
    its config.json: the family and the components first, then every key of :func:`model_keys` of that
    model, and :data:`CARRIED`. A key the user did not type takes the checkpoint's value; every typed key of
    the model that differs is listed in one error. Returns the saved config (parsed, as data)."""
    from ipuft.config.migrate import saved_config_data
    from ipuft.io.checkpoint import find_checkpoint

    found = find_checkpoint(cfg.model.init_checkpoint)
    saved = saved_config_data(found)
    mismatches = []

    def take(keys: Iterable[str], fixed: bool) -> None:
        for key, value, current in differences(saved, cfg, keys):
            if _typed(key, typed):
                if fixed:
                    mismatches.append(f"{key}={current} but the checkpoint has {str(value)[:40]}")
                continue
            try:
                OmegaConf.update(cfg, key, value, merge=True)
            except OmegaConfBaseException:
                raise CheckpointError(f"checkpoint {found}: config.yaml: {key} is {str(value)[:40]!r}, not a value "
                                      f"{key} takes") from None

    take(COMPONENT_KEYS, fixed=True)
    if not mismatches:  # the model's keys are those of the checkpoint's family and components
        take(model_keys(cfg, sections)[len(COMPONENT_KEYS):], fixed=True)
    take(CARRIED, fixed=False)
    if mismatches:
        raise ConfigError(f"model.init_checkpoint {found}: {'; '.join(mismatches)} (drop those settings: the "
                          f"checkpoint's weights fix the model)")
    return saved
