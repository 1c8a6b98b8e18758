"""Every hook ipuft defines. Plugins implement them with ``@ipuft.hookimpl`` and are found through the
``ipuft`` entry-point group. Core calls them only through :class:`ipuft.plugins.PluginHooks`.

Grouped by when they run: registration (at start-up), then model construction (per run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import click
    import torch
    from omegaconf import DictConfig

    from ipuft.components import ComponentRegistry, VariableSpec
    from ipuft.config.sections import ConfigSectionRegistry
    from ipuft.families import ModelFamilyRegistry
    from ipuft.loggers import LoggerRegistry
    from ipuft.optim import OptimizerRegistry
    from ipuft.program import StepProgram
    from ipuft.sharding import ShardSpec

PROJECT = "ipuft"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- registration ---------------------------------------------------------------------------------


@hookspec
def ipuft_register_components(registry: ComponentRegistry) -> None:
    """Register component builders ("graph creation") with ``registry.add(role, name, build)``.

    :param registry: core's registry; ``role`` is ``embeddings``, ``decoder`` or ``head``, and ``build``
        takes the resolved config and returns a plain ``nn.Module`` following
        :mod:`ipuft.components`. A name registered twice for one role is an error.
    """


@hookspec
def ipuft_register_optimizers(registry: OptimizerRegistry) -> None:
    """Register optimizers with ``registry.add(name, build)``; ``training.optimizer.name`` picks one.

    :param registry: core's registry; ``build`` takes the resolved config and returns an
        :class:`ipuft.optim.Optimizer`. A name registered twice is an error.
    """


@hookspec
def ipuft_register_loggers(registry: LoggerRegistry) -> None:
    """Register logging backends with ``registry.add(name, build)``; ``logging.backends`` picks them.

    :param registry: core's registry; ``build(cfg, run_dir)`` returns an :class:`ipuft.loggers.Logger`, which
        receives the config at start, every step's metrics record, and the end of the run, on rank 0. A
        backend that raises costs one warning line and is dropped; training goes on.
    """


@hookspec
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    """Contribute typed config sections with ``registry.add(name, dataclass_type)``.

    Each section appears at ``plugins.<name>`` in the config, typed by the dataclass, so an unknown key or
    a wrong type inside it is an error like any other.
    """


@hookspec
def ipuft_register_model_families(registry: ModelFamilyRegistry) -> None:
    """Register the Hugging Face architectures your components compute with ``registry.add(ModelFamily(...))``
    (see :mod:`ipuft.families`): ``model.hf_checkpoint`` picks one by its config.json's ``model_type``, and
    ``ipuft export`` writes the run's ``model.family``. A ``model_type`` registered twice is an error.
    """


@hookspec
def ipuft_register_commands(cli: click.Group) -> None:
    """Add subcommands to the ``ipuft`` command line with ``cli.add_command(command)``."""


# ---- model construction ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def ipuft_shard_spec(
    role: str, name: str, variables: list[VariableSpec], tensor_parallel: int, cfg: DictConfig
) -> dict[str, ShardSpec] | None:
    """Say how the variables of component ``name`` (of ``role``), registered without ``shard_specs``, split
    over the tensor-parallel ranks: a layout computed from the variables or the run's config (a registration's
    ``shard_specs`` is a fixed mapping), for your own component or another plugin's.

    ``cfg`` is the run's resolved config, for a layout that depends on more than the shapes (say, whether
    TP divides the key/value heads); like every hook argument, an implementation may leave it out.

    Answer only for the components you mean, with one :class:`ipuft.sharding.ShardSpec` per variable name;
    return ``None`` otherwise. A component nobody answers for is fully replicated (``tensor_parallel``
    must then be 1).

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def ipuft_adapt_component(adapter: str, role: str, name: str, module: torch.nn.Module,
                          cfg: DictConfig) -> torch.nn.Module | None:
    """Adapt the built component ``name`` (of ``role``) for ``model.adapter=adapter`` (``lora``), as a
    parameter-efficient fine-tuning method does: return the module, changed in place or replaced, or ``None``
    when ``adapter`` is not yours (or leaves this role as it is).

    It is called with every component of the run, each built on the meta device (twice under tensor
    parallelism: at ``tensor_parallel=1`` for the full variables, and at the run's for what a rank computes,
    as ``cfg`` says). The adapted module follows the component contract; its ``variable_specs()`` give the
    variables it adds ``added=True`` and may freeze the base's (``trainable=False``). When it adds any, its
    ``adapter_shard_specs(base)`` says how they split over the TP ranks, given the base variables' resolved
    :class:`ipuft.sharding.ShardSpec` (the component's own answer, for its own variables). An adapter
    that no plugin answers for, for any role, is a config error.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def ipuft_emit_phases(program: StepProgram, role: str, name: str) -> bool | None:
    """Emit the phases of component ``name`` (of ``role``) into ``program`` with ``program.emit``.

    Answer only for your own components and return ``True``; return ``None`` otherwise. Core validates
    the finished program's dataflow (see :meth:`ipuft.program.StepProgram.validate`).

    Stops at the first non-None result.
    """
