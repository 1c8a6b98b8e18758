"""Plugin wiring: one factory that builds the plugin manager, and the thin typed wrapper that holds every
``pm.hook.*`` call, so the rest of ipuft never touches pluggy directly.

Plugins are found only through the ``ipuft`` entry-point group; core never imports a plugin package.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
from omegaconf import DictConfig

from ipuft import __version__, hookspecs
from ipuft.components import ROLES, ComponentRegistry, VariableSpec
from ipuft.config.sections import ConfigSectionRegistry
from ipuft.errors import IpuftError, PluginError
from ipuft.loggers import JSONL, LoggerRegistry
from ipuft.optim import Optimizer, OptimizerRegistry
from ipuft.sharding import ShardSpec

if TYPE_CHECKING:
    import click

    from ipuft.program import StepProgram

ENTRY_POINT_GROUP = hookspecs.PROJECT
DISABLE_ENV = "IPUFT_DISABLE_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    """Where a loaded plugin came from."""

    name: str
    distribution: str
    version: str
    module: str


def disabled_from_env() -> set[str]:
    """Entry-point (or distribution) names listed, comma-separated, in ``IPUFT_DISABLE_PLUGINS``."""
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def create_plugin_manager(
    disabled: Iterable[str] | None = None, extra_plugins: Sequence[tuple[str, object]] = ()
) -> PluginHooks:
    """Load every ``ipuft`` entry point except the disabled ones, then ``extra_plugins``; check hook names.

    ``disabled`` defaults to :func:`disabled_from_env`. ``extra_plugins`` are ``(name, module_or_object)``
    pairs registered after the entry points (tests and embedding applications use it).
    """
    blocked = disabled_from_env() if disabled is None else set(disabled)
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    infos: dict[str, PluginInfo] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist_name = ep.dist.metadata["Name"] if ep.dist else "(unknown)"
        dist_version = ep.dist.version if ep.dist else "(unknown)"
        if ep.name in blocked or dist_name in blocked:
            pm.set_blocked(ep.name)
            continue
        if ep.name in infos:
            if infos[ep.name].distribution == dist_name:
                continue  # the same distribution seen twice on sys.path
            raise PluginError(
                f"plugin name {ep.name!r} is declared by two distributions, {infos[ep.name].distribution} and "
                f"{dist_name}; uninstall one or set {DISABLE_ENV}"
            )
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 (any import failure is the plugin's, reported as one line)
            raise PluginError(
                f"plugin {ep.name!r} (distribution {dist_name} {dist_version}) failed to import: "
                f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={ep.name}"
            ) from None
        _register(pm, plugin, ep.name)
        infos[ep.name] = PluginInfo(ep.name, dist_name, dist_version, ep.value)
    for name, plugin in builtin_plugins():
        if name not in blocked:
            _register(pm, plugin, name)
            infos[name] = PluginInfo(name, "ipuft", __version__, plugin.__name__)
    for name, plugin in extra_plugins:
        _register(pm, plugin, name)
        infos[name] = PluginInfo(name, "(in-process)", "", getattr(plugin, "__name__", type(plugin).__name__))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc}; the hook names ipuft defines are in docs/plugins.md") from None
    return PluginHooks(pm, infos)


def builtin_plugins() -> list[tuple[str, object]]:
    """Plugins that ship inside ipuft itself: the logging backends (TensorBoard, W&B)."""
    from ipuft import loggers

    return [("ipuft.loggers", loggers)]


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginError(f"plugin {name!r} cannot be registered: {exc}") from None


@dataclass
class Registrations:
    """What the registration hooks produced, with who registered what."""

    components: ComponentRegistry = field(default_factory=ComponentRegistry)
    optimizers: OptimizerRegistry = field(default_factory=OptimizerRegistry)
    loggers: LoggerRegistry = field(default_factory=LoggerRegistry)
    config_sections: ConfigSectionRegistry = field(default_factory=ConfigSectionRegistry)

    def check(self, cfg: DictConfig) -> None:
        """Check that the components, the optimizer and the logging backends ``cfg`` names are registered."""
        for role in ROLES:
            self.components.get(role, cfg.model[role])
        self.optimizers.get(cfg.training.optimizer.name)
        for name in cfg.logging.backends:
            if name != JSONL:
                self.loggers.get(name)

    def build_optimizer(self, cfg: DictConfig) -> Optimizer:
        """The optimizer ``training.optimizer.name`` names, built from ``cfg``."""
        return self.optimizers.get(cfg.training.optimizer.name).build(cfg)


class PluginHooks:
    """The typed face of the plugin manager: one method per hook."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
        self.pm = pm
        self.infos = infos
        self._registrations: Registrations | None = None

    # ---- registration hooks, called plugin by plugin so that registries know who registered what ----

    def _call_each(self, hook_name: str, registry: Any) -> None:
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            registry.bind_plugin(impl.plugin_name)
            try:
                impl.function(**{arg: registry for arg in impl.argnames})
            except IpuftError:
                raise
            except Exception as exc:  # noqa: BLE001 (the plugin's bug, reported as one line naming it)
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed in {hook_name}: {type(exc).__name__}: {exc}"
                ) from None

    @property
    def registrations(self) -> Registrations:
        """Components, optimizers and config sections of every plugin (computed once)."""
        if self._registrations is None:
            reg = Registrations()
            self._call_each("ipuft_register_components", reg.components)
            self._call_each("ipuft_register_optimizers", reg.optimizers)
            self._call_each("ipuft_register_loggers", reg.loggers)
            self._call_each("ipuft_register_config_sections", reg.config_sections)
            self._registrations = reg
        return self._registrations

    def register_commands(self, cli: click.Group) -> dict[str, list[str]]:
        """Let plugins add subcommands; returns the commands each plugin added."""
        added: dict[str, list[str]] = {}
        for impl in self.pm.hook.ipuft_register_commands.get_hookimpls():
            before = set(cli.commands)
            impl.function(cli=cli)
            added[impl.plugin_name] = sorted(set(cli.commands) - before)
        return added

    # ---- model construction hooks ----

    def shard_spec(
        self, role: str, name: str, variables: list[VariableSpec], tensor_parallel: int
    ) -> dict[str, ShardSpec] | None:
        """The owning plugin's shard specs for component ``name`` of ``role``, or ``None``."""
        return self.pm.hook.ipuft_shard_spec(
            role=role, name=name, variables=variables, tensor_parallel=tensor_parallel
        )

    def emit_phases(self, program: StepProgram, role: str, name: str) -> None:
        """Have the owning plugin emit the phases of component ``name``; an error if no plugin does."""
        if not self.pm.hook.ipuft_emit_phases(program=program, role=role, name=name):
            raise PluginError(f"model.{role}: no plugin emits the phases of {role} component {name!r}")

    # ---- introspection ----

    def describe(self) -> list[dict[str, Any]]:
        """For each plugin: name, distribution, version and what it registers (``ipuft plugins``)."""
        reg = self.registrations
        out = []
        for name, info in sorted(self.infos.items()):
            out.append(
                {
                    "name": name,
                    "distribution": info.distribution,
                    "version": info.version,
                    "module": info.module,
                    "components": [f"{b.role}:{b.name}" for b in reg.components if b.plugin == name],
                    "optimizers": [b.name for b in reg.optimizers if b.plugin == name],
                    "loggers": [b.name for b in reg.loggers if b.plugin == name],
                    "config_sections": [f"plugins.{s}" for s in reg.config_sections
                                        if reg.config_sections.owner(s) == name],
                    "hooks": sorted(h.name for h in self.pm.get_hookcallers(self.pm.get_plugin(name)) or []),
                }
            )
        return out
