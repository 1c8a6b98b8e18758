"""Plugin-contributed config sections, typed by their dataclasses, placed at ``plugins.<name>``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from ipuft.errors import PluginError
from ipuft.registry import Registry

if TYPE_CHECKING:
    from ipuft.families import ModelFamilyRegistry


class ConfigSectionRegistry(Registry):
    """The typed config sections plugins contribute; refuses duplicates and non-dataclasses."""

    kind = "config section"

    def __init__(self) -> None:
        super().__init__()
        self._sections: dict[str, type] = {}
        self._used_when: dict[str, dict[str, str]] = {}
        self._model_keys: dict[str, tuple[str, ...]] = {}
        # The model families registered beside these sections (see ipuft.plugins.Registrations): a Hugging Face
        # config.json is read into config keys through them.
        self.families: ModelFamilyRegistry | None = None

    def add(self, name: str, schema: type, used_when: Mapping[str, str] | None = None,
            model_keys: Iterable[str] = ()) -> None:
        """Contribute section ``plugins.<name>`` typed by the dataclass ``schema``.

        ``used_when``: the settings under which the section means anything, for example
        ``{"training.optimizer.name": "adamw"}``; setting one of its keys otherwise is an error (a value that
        would silently do nothing).
        ``model_keys``: the section's fields that are part of the model wherever the section is used (a
        component's options that shape its weights or what they compute, such as an adapter's rank): a
        checkpoint fixes them, as it fixes the model's shapes (:mod:`ipuft.config.identity`).
        """
        origin = self.origin()
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            raise PluginError(f"plugin {origin.plugin!r}: config section {name!r} must be a dataclass type")
        if not name.isidentifier():
            raise PluginError(f"plugin {origin.plugin!r}: config section name {name!r} is not an identifier")
        fields = {f.name for f in dataclasses.fields(schema)}
        if unknown := [key for key in model_keys if key not in fields]:
            raise PluginError(f"plugin {origin.plugin!r}: config section {name!r} names model key {unknown[0]!r}, "
                              f"which is not a field of {schema.__name__}")
        if self._claim(name, f"config section plugins.{name}", origin):
            self._sections[name] = schema
            self._used_when[name] = dict(used_when or {})
            self._model_keys[name] = tuple(model_keys)

    def unused_settings(self, cfg, typed: set[str]) -> list[str]:
        """For each section whose ``used_when`` ``cfg`` does not meet, the keys of it the user set, as
        ``"plugins.adamw.beta1 (used when training.optimizer.name=adamw)"``."""
        from omegaconf import OmegaConf

        found = []
        for name, when in self._used_when.items():
            unmet = [f"{k}={v}" for k, v in when.items() if str(OmegaConf.select(cfg, k)) != v]
            if unmet:
                found += [f"{key} (used when {', '.join(unmet)})" for key in sorted(typed)
                          if key.startswith(f"plugins.{name}.")]
        return found

    def used_when(self, name: str) -> dict[str, str]:
        """The settings under which section ``name`` means anything (empty: always)."""
        return dict(self._used_when[name])

    def model_keys(self, name: str) -> tuple[str, ...]:
        """The fields of section ``name`` that are part of the model (see :meth:`add`)."""
        return self._model_keys[name]

    def owner(self, name: str) -> str:
        return self._origins[name].plugin

    def schema_type(self) -> type:
        """A dataclass with one field per section, each defaulting to its dataclass's defaults."""
        fields = [(n, t, dataclasses.field(default_factory=t)) for n, t in sorted(self._sections.items())]
        return dataclasses.make_dataclass("PluginSections", fields)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._sections))
