"""Plugin-contributed config sections, typed by their dataclasses, placed at ``plugins.<name>``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ipuft.errors import PluginError


class ConfigSectionRegistry:
    """The typed config sections plugins contribute; refuses duplicates and non-dataclasses."""

    def __init__(self) -> None:
        self._sections: dict[str, type] = {}
        self._owners: dict[str, str] = {}
        self._plugin = ""

    def bind_plugin(self, plugin: str) -> None:
        """Attribute the next registrations to ``plugin`` (done by the hook wrapper, plugin by plugin)."""
        self._plugin = plugin

    def add(self, name: str, schema: type) -> None:
        """Contribute section ``plugins.<name>`` typed by the dataclass ``schema``."""
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            raise PluginError(f"plugin {self._plugin!r}: config section {name!r} must be a dataclass type")
        if not name.isidentifier():
            raise PluginError(f"plugin {self._plugin!r}: config section name {name!r} is not an identifier")
        if name in self._sections:
            raise PluginError(
                f"config section plugins.{name} is contributed twice: by plugin {self._owners[name]!r} "
                f"and by plugin {self._plugin!r}"
            )
        self._sections[name] = schema
        self._owners[name] = self._plugin

    def owner(self, name: str) -> str:
        return self._owners[name]

    def schema_type(self) -> type:
        """A dataclass with one field per section, each defaulting to its dataclass's defaults."""
        fields = [(n, t, dataclasses.field(default_factory=t)) for n, t in sorted(self._sections.items())]
        return dataclasses.make_dataclass("PluginSections", fields)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._sections))
