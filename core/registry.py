"""A registry of named builders that plugins fill through a registration hook (optimizers, logging
backends): core owns it, so it can list every name, attribute each to its plugin and refuse duplicates."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ipuft.errors import PluginError, choices


@dataclass(frozen=True)
class Builder:
    """A named way to build something from the resolved config, and the plugin that registered it."""

    name: str
    build: Callable[..., Any]
    description: str = ""
    plugin: str = ""


class NamedRegistry:
    """Builders by name. ``kind`` names what is built and ``key`` the config key that selects it, in errors."""

    kind = "builder"
    key = ""

    def __init__(self) -> None:
        self._builders: dict[str, Builder] = {}
        self._plugin = ""

    def bind_plugin(self, plugin: str) -> None:
        """Attribute the next registrations to ``plugin`` (done by the hook wrapper, plugin by plugin)."""
        self._plugin = plugin

    def add(self, name: str, build: Callable[..., Any], description: str = "") -> None:
        """Register ``build`` as ``name``; the config key :attr:`key` selects it by that name."""
        if name in self._builders:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin {self._builders[name].plugin!r} "
                f"and by plugin {self._plugin!r}; disable one with IPUFT_DISABLE_PLUGINS"
            )
        self._builders[name] = Builder(name, build, description, self._plugin)

    def get(self, name: str) -> Builder:
        try:
            return self._builders[name]
        except KeyError:
            raise PluginError(
                f"{self.key}: unknown {self.kind} {name!r}; available: {choices(self._builders)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._builders)

    def __iter__(self) -> Iterator[Builder]:
        return iter(self._builders.values())
