"""Assemble a model from the resolved config: one component per role, from the registered builders, with
its variable specs, its shard specs, and the step program its plugins emit.

Modules are built on the meta device: they hold no memory. The engine owns the variables and runs the
modules with ``torch.func.functional_call``, so even GPT-J-6B assembles (and plans) in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ipuft.components import ROLES, Component, ComponentBuilder, VariableSpec
from ipuft.errors import PluginError
from ipuft.plugins import PluginHooks
from ipuft.program import StepProgram
from ipuft.sharding import ShardSpec, resolve_shard_specs


@dataclass
class ModelParts:
    """The three components of a model and what the engine needs to know about each."""

    builders: dict[str, ComponentBuilder]
    modules: dict[str, torch.nn.Module]
    variables: dict[str, list[VariableSpec]]
    shard_specs: dict[str, dict[str, ShardSpec]]
    program: StepProgram


def build_component(cfg: DictConfig, builder: ComponentBuilder, device: str | torch.device = "meta"):
    """Build one component module on ``device`` and check that it follows the component contract."""
    with torch.device(device):
        module = builder.build(cfg)
    if not isinstance(module, torch.nn.Module) or not isinstance(module, Component):
        raise PluginError(
            f"{builder.role} component {builder.name!r} of plugin {builder.plugin!r} must return an nn.Module "
            f"with variable_specs() and hf_mapping()"
        )
    return module


def build_model(cfg: DictConfig, hooks: PluginHooks, device: str | torch.device = "meta") -> ModelParts:
    """Build every component named by ``model.embeddings``, ``model.decoder`` and ``model.head``."""
    components = hooks.registrations.components
    builders = {role: components.get(role, cfg.model[role]) for role in ROLES}
    modules = {role: build_component(cfg, b, device) for role, b in builders.items()}
    variables = {role: m.variable_specs() for role, m in modules.items()}
    tp = cfg.execution.tensor_parallel
    shard_specs = {
        role: resolve_shard_specs(
            f"{role} component {b.name!r}", variables[role], hooks.shard_spec(role, b.name, variables[role], tp), tp
        )
        for role, b in builders.items()
    }
    program = StepProgram(cfg.model.layers)
    for role, b in builders.items():
        hooks.emit_phases(program, role, b.name)
    program.validate()
    return ModelParts(builders, modules, variables, shard_specs, program)
