"""Plugin wiring: one factory that builds the plugin manager, and the thin typed wrapper that holds every
``pm.hook.*`` call, so the rest of ipuft never touches pluggy directly.

Plugins are found only through the ``ipuft`` entry-point group; core never imports a plugin package.
Every hook is called through pluggy, once, so ``wrapper=True`` (and old-style ``hookwrapper``),
``tryfirst`` and ``trylast`` behave as pluggy documents them.

Each plugin is registered with its hook implementations bound to its name (:class:`BoundPlugin`): while an
implementation runs, core knows which plugin's it is, without looking at call stacks. So a registry
attributes each registration to its plugin (:func:`ipuft.registry.registering`), and an exception a plugin
raises in a hook is one line naming the plugin and the hook (:class:`~ipuft.errors.PluginError`);
``IPUFT_DEBUG=1`` (or ``ipuft --debug``) adds the full traceback, for import failures too.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
from omegaconf import DictConfig

from ipuft import __version__, hookspecs
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.config.sections import ConfigSectionRegistry
from ipuft.errors import IpuftError, PluginError, described
from ipuft.families import ModelFamilyRegistry
from ipuft.loggers import LoggerRegistry
from ipuft.optim import Optimizer, OptimizerRegistry
from ipuft.registry import PLAIN, TRYFIRST, TRYLAST, Origin, current_origin, registering
from ipuft.sharding import ShardSpec

if TYPE_CHECKING:
    import click
    import torch

    from ipuft.program import StepProgram

ENTRY_POINT_GROUP = hookspecs.PROJECT
DISABLE_ENV = "IPUFT_DISABLE_PLUGINS"
DEBUG_ENV = "IPUFT_DEBUG"


def debugging() -> bool:
    """``IPUFT_DEBUG=1``: errors come with their full traceback besides the one line."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


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


@contextmanager
def plugin_errors(line: Callable[[Exception], str]) -> Iterator[None]:
    """Run a plugin's code: an :class:`IpuftError` it raises passes as it is (it is already one line); any other
    exception, the plugin's bug, becomes the one :class:`PluginError` line ``line(exc)`` (its traceback kept,
    as the cause, only under ``IPUFT_DEBUG=1``)."""
    try:
        yield
    except IpuftError:
        raise
    except Exception as exc:  # noqa: BLE001 (a plugin's bug, reported as one line naming it)
        raise PluginError(line(exc)) from (exc if debugging() else None)


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
            error = PluginError(
                f"plugin {ep.name!r} (distribution {dist_name} {dist_version}) failed to import: "
                f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={ep.name} "
                f"({DEBUG_ENV}=1 shows the traceback)"
            )
            raise error from (exc if debugging() else None)
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
    # pluggy refuses one plugin object under two names; a BoundPlugin is new each time, so core checks.
    twice = [p for p in pm.get_plugins() if isinstance(p, BoundPlugin) and p.plugin is plugin]
    try:
        if twice:
            raise ValueError(f"already registered as {pm.get_name(twice[0])!r}")
        pm.register(BoundPlugin(pm, plugin, name), name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginError(f"plugin {name!r} cannot be registered: {exc}") from None


class BoundPlugin:
    """A plugin as core registers it with pluggy: each of ``plugin``'s hook implementations (found as pluggy
    finds them) in its place, bound to the plugin's ``name`` (:func:`bind_hook_implementation`). pluggy reads
    them from this object's attributes; ``plugin`` is the module or object itself."""

    def __init__(self, pm: pluggy.PluginManager, plugin: object, name: str) -> None:
        self.plugin = plugin
        for attr in dir(plugin):
            opts = pm.parse_hookimpl_opts(plugin, attr)
            if opts is not None:
                origin = Origin(name, TRYFIRST if opts.get("tryfirst") else TRYLAST if opts.get("trylast") else PLAIN)
                setattr(self, attr, bind_hook_implementation(getattr(plugin, attr), opts.get("specname") or attr,
                                                             origin))


def bind_hook_implementation(function: Callable, hook_name: str, origin: Origin) -> Callable:
    """``function``, an implementation of ``hook_name`` by ``origin``'s plugin, run so that what it registers
    is attributed to that plugin (:func:`ipuft.registry.registering`) and an exception it raises is one line
    naming the plugin and the hook (an :class:`IpuftError` passes as it is).

    The result has ``function``'s signature and marker (pluggy reads both), and is a generator function where
    ``function`` is one, so that a wrapper stays a wrapper: the other implementations it yields to run with
    their own plugins' names, nested inside its own."""
    def failed(exc: Exception) -> str:
        return (f"plugin {origin.plugin!r} failed in {hook_name}: {described(exc)} ({DEBUG_ENV}=1 shows the "
                f"traceback)")

    if inspect.isgeneratorfunction(function):
        @functools.wraps(function)
        def wrapper(*args: Any) -> Any:
            with registering(origin), plugin_errors(failed):
                return (yield from function(*args))

        return wrapper

    @functools.wraps(function)
    def implementation(*args: Any) -> Any:
        with registering(origin), plugin_errors(failed):
            return function(*args)

    return implementation


@dataclass
class Registrations:
    """What the registration hooks produced, with who registered what."""

    components: ComponentRegistry = field(default_factory=ComponentRegistry)
    optimizers: OptimizerRegistry = field(default_factory=OptimizerRegistry)
    loggers: LoggerRegistry = field(default_factory=LoggerRegistry)
    config_sections: ConfigSectionRegistry = field(default_factory=ConfigSectionRegistry)
    families: ModelFamilyRegistry = field(default_factory=ModelFamilyRegistry)

    def __post_init__(self) -> None:
        # A Hugging Face checkpoint's config.json sets config keys through its family (ipuft.families), so the
        # config is loaded with both: load_config takes the sections, which carry the families.
        self.config_sections.families = self.families

    def build_optimizer(self, cfg: DictConfig) -> Optimizer:
        """The optimizer ``training.optimizer.name`` names, built from ``cfg``."""
        name = cfg.training.optimizer.name
        registration = self.optimizers.get(name)
        optimizer = registration.build(cfg)
        if not isinstance(optimizer, Optimizer):  # the engine calls only what the contract declares
            raise PluginError(f"training.optimizer.name={name}: plugin '{registration.plugin}' built a "
                              f"{type(optimizer).__name__}, not an ipuft.optim.Optimizer; subclass it")
        optimizer.elementwise = self.optimizers.elementwise(name)  # what its registration declared
        return optimizer


class PluginHooks:
    """The typed face of the plugin manager: one method per hook, each calling it through ``pm.hook``."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
        self.pm = pm
        self.infos = infos
        self._registrations: Registrations | None = None
        self.commands: dict[str, list[str]] = {}

    # ---- calling hooks ----

    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """Call hook ``hook_name`` through pluggy. An :class:`IpuftError` a plugin raises passes as it is; any
        other exception is one :class:`PluginError` line naming the plugin and the hook (each implementation
        is bound to its plugin, :func:`bind_hook_implementation`); where pluggy itself refuses what an
        implementation did (a wrapper that does not yield), one line with pluggy's message."""
        with plugin_errors(lambda exc: f"{hook_name}: {described(exc)} ({DEBUG_ENV}=1 shows the traceback)"):
            return getattr(self.pm.hook, hook_name)(**kwargs)

    # ---- registration hooks ----

    def _register(self, hook_name: str, registry: Any) -> None:
        self.call(hook_name, registry=registry)

    @property
    def registrations(self) -> Registrations:
        """Components, optimizers, logging backends, config sections and model families of every plugin
        (computed once)."""
        if self._registrations is None:
            reg = Registrations()
            self._register("ipuft_register_components", reg.components)
            self._register("ipuft_register_optimizers", reg.optimizers)
            self._register("ipuft_register_loggers", reg.loggers)
            self._register("ipuft_register_config_sections", reg.config_sections)
            self._register("ipuft_register_model_families", reg.families)
            self._registrations = reg
        return self._registrations

    def register_commands(self, cli: click.Group) -> dict[str, list[str]]:
        """Let plugins add subcommands; returns (and keeps) the commands each plugin added."""
        add_command = cli.add_command
        added: dict[str, list[str]] = {}

        def attributed(command, name=None):
            add_command(command, name)
            added.setdefault(current_origin().plugin, []).append(name or command.name)

        cli.add_command = attributed  # type: ignore[method-assign]
        try:
            self.call("ipuft_register_commands", cli=cli)
        finally:
            del cli.add_command  # the instance attribute goes; the class's method is back
        self.commands = {plugin: sorted(names) for plugin, names in added.items()}
        return self.commands

    # ---- model construction hooks ----

    def shard_spec(
        self, role: str, name: str, variables: list[VariableSpec], tensor_parallel: int, cfg: DictConfig
    ) -> dict[str, ShardSpec] | None:
        """A plugin's answer to ``ipuft_shard_spec`` for component ``name`` of ``role``, or ``None``."""
        return self.call("ipuft_shard_spec", role=role, name=name, variables=variables,
                         tensor_parallel=tensor_parallel, cfg=cfg)

    def adapt_component(self, adapter: str, role: str, name: str, module: torch.nn.Module,
                        cfg: DictConfig) -> torch.nn.Module | None:
        """A plugin's adaptation of component ``name`` for ``model.adapter=adapter``, or ``None``."""
        return self.call("ipuft_adapt_component", adapter=adapter, role=role, name=name, module=module, cfg=cfg)

    def emit_phases(self, program: StepProgram, role: str, name: str) -> None:
        """Have a plugin emit the phases of component ``name``; if none answers, core emits the role's
        standard phases (:func:`ipuft.program.emit_standard_phases`)."""
        if not self.call("ipuft_emit_phases", program=program, role=role, name=name):
            from ipuft.program import emit_standard_phases

            emit_standard_phases(program, role)

    # ---- introspection ----

    def describe(self) -> list[dict[str, Any]]:
        """For each plugin: name, distribution, version and what it registers (``ipuft plugins``)."""
        reg = self.registrations
        shadowed = [(kind, name, first, second) for kind, registry in
                    (("components", reg.components), ("optimizers", reg.optimizers), ("loggers", reg.loggers),
                     ("config_sections", reg.config_sections), ("model_families", reg.families))
                    for name, first, second in registry.shadowed]
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
                    "model_families": [f.model_type for f in reg.families if f.plugin == name],
                    "commands": self.commands.get(name, []),
                    "shadowed": [f"{label} (overridden by plugin {first.plugin!r})"
                                 for _, label, first, second in shadowed if second.plugin == name],
                    "hooks": sorted(h.name for h in self.pm.get_hookcallers(self.pm.get_plugin(name)) or []),
                }
            )
        return out
