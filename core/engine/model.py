"""Assemble a model from the resolved config: one component per role, from the registered builders, with
its variable specs, its shard specs, and the step program its plugins emit.

Modules are built on the meta device: they hold no memory. The engine owns the variables and runs the
modules with a unit's tensors bound in place of their parameters (:func:`ipuft.components.bound`), so even
GPT-J-6B assembles (and plans) in seconds.

Each component is built twice under tensor parallelism: at TP=1 for the full variables (what the store
initialises, checkpoints and Hugging Face see) and at the run's TP for the module each rank computes with.
The shard specs must turn the first's shapes into the second's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft.components import ROLES, Adapted, Component, ComponentBuilder, VariableSpec
from ipuft.config.rules import check_plugins
from ipuft.errors import ConfigError, PluginError, described
from ipuft.optim import Optimizer
from ipuft.plugins import PluginHooks, plugin_errors
from ipuft.precision import compute_dtype
from ipuft.program import StepProgram, Tie, Unit
from ipuft.sharding import ShardSpec, resolve_shard_specs


@dataclass
class ModelParts:
    """The three components of a model and what the engine needs to know about each."""

    builders: dict[str, ComponentBuilder]
    modules: dict[str, torch.nn.Module]  # at the run's tensor parallelism: what a rank computes with
    variables: dict[str, list[VariableSpec]]  # full variables, as at TP=1
    shard_specs: dict[str, dict[str, ShardSpec]]
    program: StepProgram
    # Each role's variables that are another unit's (tied, :class:`ipuft.program.Tie`): not in ``variables``,
    # which are what the role owns; their specs here carry the owner's dtype and trainability.
    tied: dict[str, list[VariableSpec]] = field(default_factory=dict)

    def uses(self, role: str) -> list[VariableSpec]:
        """Every variable a unit of ``role`` computes with: its own and the tied ones it uses."""
        return [*self.variables[role], *self.tied.get(role, ())]


def blamed(builder: ComponentBuilder, what: str):
    """A plugin's component failing in ``what`` (its build, ``variable_specs()``): one line naming it, not a
    traceback (``IPUFT_DEBUG=1`` keeps the traceback)."""
    return plugin_errors(lambda exc: f"{builder.role} component {builder.name!r} of plugin {builder.plugin!r} "
                                     f"failed in {what}: {described(exc)}")


def build_component(cfg: DictConfig, builder: ComponentBuilder):
    """Build one component module on the meta device and check that it follows the component contract."""
    with torch.device("meta"), blamed(builder, "its build"):
        module = builder.build(cfg)
    if not isinstance(module, torch.nn.Module) or not isinstance(module, Component):
        raise PluginError(
            f"{builder.role} component {builder.name!r} of plugin {builder.plugin!r} must return an nn.Module "
            f"with variable_specs() and hf_mapping()"
        )
    return module


def component_variables(builder: ComponentBuilder, module) -> list:
    with blamed(builder, "variable_specs()"):
        return module.variable_specs()


def build_model(cfg: DictConfig, hooks: PluginHooks, optimizer: Optimizer | None = None) -> ModelParts:
    """Build every component named by ``model.embeddings``, ``model.decoder`` and ``model.head``, after the
    config's plugin rules and before its model rules (:mod:`ipuft.config.rules`; those of the run's
    ``optimizer`` with it, for a run that trains)."""
    check_plugins(cfg, hooks.registrations)
    components = hooks.registrations.components
    builders = {role: components.get(role, cfg.model[role]) for role in ROLES}
    modules = adapted(cfg, hooks, builders, {role: build_component(cfg, b) for role, b in builders.items()})
    tp = cfg.execution.tensor_parallel
    if tp == 1:
        variables = {role: component_variables(builders[role], m) for role, m in modules.items()}
    else:
        single = OmegaConf.merge(cfg, {"execution": {"tensor_parallel": 1}})
        full = adapted(single, hooks, builders, {role: build_component(single, b) for role, b in builders.items()})
        variables = {role: component_variables(b, full[role]) for role, b in builders.items()}
    # model.precision: every floating variable is stored and computed with in the run's dtype.
    dtype = compute_dtype(cfg)
    variables = {role: [replace(v, dtype=dtype) if v.dtype.is_floating_point else v for v in specs]
                 for role, specs in variables.items()}
    # model.freeze: every variable of those roles is frozen.
    variables = {role: [replace(v, trainable=False) if role in cfg.model.freeze else v for v in specs]
                 for role, specs in variables.items()}
    shard_specs = {}
    for role, b in builders.items():
        who = f"{role} component {b.name!r}"
        specs = _shard_specs(who, b, modules[role], variables[role], hooks, cfg)
        local = {v.name: v.shape for v in component_variables(b, modules[role])}
        expected = {v.name: specs[v.name].local_shape(v.shape, tp) for v in variables[role]}
        if local != expected:
            raise PluginError(f"{who}: its module at tensor_parallel={tp} has variables {local}, but its shard "
                              f"specs give {expected}")
        shard_specs[role] = specs
    variables, tied, ties = _split_ties(variables, shard_specs, cfg.model.layers)
    if cfg.model.tie_embeddings and not any(t.role == "head" and t.owner.role == "embeddings" for t in ties):
        raise ConfigError(f"model.tie_embeddings=true, but head component {builders['head'].name!r} of plugin "
                          f"{builders['head'].plugin!r} ties none of its variables to the embeddings; use a head "
                          f"that can (gptj, llama) or model.tie_embeddings=false")
    program = StepProgram(cfg.model.layers, ties)
    for role, b in builders.items():
        hooks.emit_phases(program, role, b.name)
    program.validate()
    parts = ModelParts(builders, modules, variables, shard_specs, program, tied)
    check_model(cfg, parts, optimizer)
    return parts


def adapted(cfg: DictConfig, hooks: PluginHooks, builders: dict[str, ComponentBuilder],
            modules: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """The components as ``model.adapter`` adapts them (``ipuft_adapt_component``); as they are without one.
    An adapter no installed plugin applies to any component is one line."""
    adapter = cfg.model.adapter
    if adapter is None:
        return modules
    out, answered = {}, False
    for role, module in modules.items():
        b = builders[role]
        with blamed(b, f"its adaptation by model.adapter={adapter}"):
            answer = hooks.adapt_component(adapter, role, b.name, module, cfg)
        out[role] = module if answer is None else answer
        answered = answered or answer is not None
    if not answered:
        raise ConfigError(f"model.adapter: no installed plugin adapts a model with {adapter!r}; null trains every "
                          f"weight, lora needs the ipuft-lora plugin (see `ipuft plugins`)")
    return out


def _shard_specs(who: str, builder: ComponentBuilder, module: torch.nn.Module, variables: list[VariableSpec],
                 hooks: PluginHooks, cfg: DictConfig) -> dict[str, ShardSpec]:
    """The component's TP layout: its registered one or a plugin's answer; for an adapted component, that of its
    base variables (the ones not ``added``) and the adapter's for the rest (its ``adapter_shard_specs``)."""
    tp = cfg.execution.tensor_parallel
    adapter = module.adapter_shard_specs if isinstance(module, Adapted) else None
    base = [v for v in variables if not v.added] if adapter is not None else variables
    answer = builder.shard_specs_for(base, tp, cfg)
    if answer is None:
        answer = hooks.shard_spec(builder.role, builder.name, base, tp, cfg)
    if adapter is None:
        return resolve_shard_specs(who, variables, answer, tp)
    answer = resolve_shard_specs(who, base, answer, tp)
    return resolve_shard_specs(who, variables, {**answer, **adapter(answer)}, tp)


def _owner(ref: str, units: list[Unit]) -> tuple[Unit, str] | None:
    """``<unit>.<variable>`` as (unit, variable), for one of ``units``; None when it names none of them."""
    unit = next((u for u in units if ref.startswith(f"{u}.")), None)
    return None if unit is None else (unit, ref[len(unit) + 1:])


def _split_ties(variables: dict[str, list[VariableSpec]], shard_specs: dict[str, dict[str, ShardSpec]],
                layers: int) -> tuple[dict[str, list[VariableSpec]], dict[str, list[VariableSpec]], tuple[Tie, ...]]:
    """Each role's own variables, the tied ones it uses (``tied_to``; with the owner's dtype and trainability),
    and the program's ties, after checking that each names another unit's own variable of the same shape and
    the same sharding, so that every rank holds the same piece of it for both uses."""
    own = {role: [v for v in specs if v.tied_to is None] for role, specs in variables.items()}
    units = StepProgram(layers).units()
    tied: dict[str, list[VariableSpec]] = {}
    ties = []
    for role, specs in variables.items():
        for v in specs:
            if v.tied_to is None:
                continue
            where = f"{role} variable {v.name} is tied to {v.tied_to}"
            owner = _owner(v.tied_to, units)
            if owner is None or owner[0].role == role:
                raise PluginError(f"{where}, which is not <unit>.<variable> of another unit of this model")
            unit, name = owner
            target = next((t for t in own[unit.role] if t.name == name), None)
            if target is None:
                raise PluginError(f"{where}, but {unit.role} has no variable {name} of its own")
            if target.shape != v.shape or shard_specs[unit.role][name] != shard_specs[role][v.name]:
                raise PluginError(f"{where}, but their shapes {tuple(v.shape)} and {tuple(target.shape)} or "
                                  f"their shard specs differ")
            tied.setdefault(role, []).append(replace(v, dtype=target.dtype, trainable=target.trainable))
            ties.append(Tie(role, v.name, unit, name, target.trainable))
    return own, tied, tuple(ties)


def check_model(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer | None = None) -> None:
    """Something of the built model is trainable; with the run's ``optimizer``, under tensor parallelism each
    optimizer-state variable has its variable's shape: state is placed (and gathered for checkpoints) like its
    variable, so an optimizer with other state runs at ``tensor_parallel=1``."""
    if not any(v.trainable for specs in parts.variables.values() for v in specs):
        raise ConfigError("model.freeze: every variable of the model is frozen, so there is nothing to train")
    tp = cfg.execution.tensor_parallel
    if optimizer is None or tp == 1:
        return
    from ipuft.engine.variables import optimizer_state_specs  # variables imports this module

    for role, variables in parts.variables.items():
        local = [replace(v, shape=parts.shard_specs[role][v.name].local_shape(v.shape, tp)) for v in variables]
        shapes = {v.name: v.shape for v in local}
        for state in optimizer_state_specs(local, optimizer):
            if state.shape != shapes[state.name.variable]:
                raise PluginError(f"optimizer state {state.name} of {role} has shape {state.shape}, not its variable's "
                                  f"{shapes[state.name.variable]}: such state cannot follow the variable's "
                                  f"tensor-parallel layout; set execution.tensor_parallel=1")
