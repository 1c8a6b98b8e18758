"""Registries that plugins fill through registration hooks (components, optimizers, logging backends,
config sections): core owns them, so it can list every name, attribute each to its plugin and decide
duplicates.

Core calls a registration hook once, through pluggy (``pm.hook``), so wrappers, ``tryfirst`` and
``trylast`` work as pluggy defines them. A registry learns which plugin is registering from
:meth:`Registry.origin`: core registers each plugin with its hook implementations bound to its name
(:class:`ipuft.plugins.BoundPlugin`), and each runs inside :func:`registering` with its origin.

**Overriding by ordering.** A name registered twice is an error, unless the two registrations come from
hook implementations of different priority (``tryfirst`` > plain > ``trylast``): pluggy calls the higher
one first, and its registration wins; the other is kept as shadowed, and ``ipuft plugins`` lists it. So a
plugin replaces a stock component by registering the same role and name from a ``tryfirst`` hookimpl,
without uninstalling anything.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ipuft.errors import PluginError, choices

TRYLAST, PLAIN, TRYFIRST = 0, 1, 2


@dataclass(frozen=True)
class Origin:
    """Who made a registration: the plugin, and the priority of the hook implementation that made it."""

    plugin: str = ""
    priority: int = PLAIN


_REGISTERING: contextvars.ContextVar[Origin | None] = contextvars.ContextVar("ipuft_registering", default=None)


@contextmanager
def registering(origin: Origin) -> Iterator[None]:
    """Attribute what is registered inside the block to ``origin`` (core runs each plugin's hook
    implementations so; blocks nest, as a wrapper's yield runs the other implementations inside it)."""
    token = _REGISTERING.set(origin)
    try:
        yield
    finally:
        _REGISTERING.reset(token)


def current_origin() -> Origin:
    """Who is registering now: the origin of the innermost :func:`registering` block (an anonymous
    :class:`Origin` outside any)."""
    origin = _REGISTERING.get()
    return Origin() if origin is None else origin


class Registry:
    """What every registry shares: who is registering, and the duplicate rule."""

    kind = "builder"

    def __init__(self) -> None:
        self.shadowed: list[tuple[str, Origin, Origin]] = []  # (name, the winner's origin, the shadowed one's)
        self._origins: dict[Any, Origin] = {}  # who registered each key

    def origin(self) -> Origin:
        """The plugin registering now, and its hook implementation's priority (:func:`current_origin`)."""
        return current_origin()

    def _claim(self, key: Any, label: str, origin: Origin) -> bool:
        """Whether ``origin``'s registration of ``key`` (``label`` in messages, say ``decoder component 'gptj'``)
        is to be stored. A key registered before keeps its first registration if that one has the higher
        priority (it ran first; the second is listed as shadowed); otherwise both are refused with one line."""
        first = self._origins.get(key)
        if first is None:
            self._origins[key] = origin
            return True
        if first.priority > origin.priority:
            self.shadowed.append((label, first, origin))
            return False
        raise PluginError(
            f"{label} is registered twice: by plugin {first.plugin!r} and by plugin {origin.plugin!r}; "
            f"disable one with IPUFT_DISABLE_PLUGINS, or register the one that should win from a hookimpl "
            f"marked tryfirst=True"
        )


@dataclass(frozen=True)
class Builder:
    """A named way to build something from the resolved config, and the plugin that registered it."""

    name: str
    build: Callable[..., Any]
    description: str = ""
    plugin: str = ""
    options: dict[str, Any] = field(default_factory=dict)


class NamedRegistry(Registry):
    """Builders by name. ``kind`` names what is built and ``key`` the config key that selects it, in errors."""

    key = ""

    def __init__(self) -> None:
        super().__init__()
        self._builders: dict[str, Builder] = {}

    def add(self, name: str, build: Callable[..., Any], description: str = "", **options: Any) -> None:
        """Register ``build`` as ``name``; the config key :attr:`key` selects it by that name. ``options``
        are what a kind of builder declares besides (see the registry's subclass)."""
        origin = self.origin()
        if self._claim(name, f"{self.kind} {name!r}", origin):
            self._builders[name] = Builder(name, build, description, origin.plugin, options)

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
