"""What one rank stores of each unit: every variable's placement, the variable groups (weights, optimizer
state, gradients) as stored specs, the names of optimizer state, and the units' initial values.

The engine allocates a unit's groups from :func:`unit_groups`, and ``ipuft plan`` sums the same specs, so the
two cannot disagree about what is stored.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ipuft.components import Init, VariableSpec
from ipuft.engine.placement import Placement
from ipuft.engine.store import Tensors
from ipuft.optim import Optimizer
from ipuft.parallel import Layout
from ipuft.program import StepProgram, Unit

if TYPE_CHECKING:  # an annotation only: engine.model runs config.rules, whose model rule reads optimizer state here
    from ipuft.engine.model import ModelParts

# ``initializer(unit, specs)``: a unit's full initial weights, float32, by variable name.
Initializer = Callable[[str, list[VariableSpec]], Tensors]


def placements(parts: ModelParts, layout: Layout, rts: bool,
               optimizer: Optimizer | None = None) -> dict[str, dict[str, Placement]]:
    """Every variable's placement, by role: with RTS, slices of whole blocks of the ``optimizer``'s block state."""
    multiple = optimizer.block_size if optimizer is not None else 1
    return {role: {v.name: Placement(v, parts.shard_specs[role][v.name], layout, rts, multiple) for v in specs}
            for role, specs in parts.variables.items()}


class StateName(str):
    """The name of one optimizer-state variable, ``<variable>.<state>`` (``attn.q_proj.weight.m``): its
    ``variable`` and ``state`` are attributes, never parsed back from the name, which is what the store keys
    and checkpoints use."""

    variable: str
    state: str

    def __new__(cls, variable: str, state: str) -> StateName:
        name = super().__new__(cls, f"{variable}.{state}")
        name.variable, name.state = variable, state
        return name

    def __reduce__(self):
        return StateName, (self.variable, self.state)


MASTER = "master"  # the optimizer-state name of a variable's float32 master copy (Recipe.master)


def float32(spec: VariableSpec) -> VariableSpec:
    """``spec`` with a float32 dtype: the view an optimizer sees, and what initializers produce."""
    return replace(spec, dtype=torch.float32) if spec.dtype.is_floating_point else spec


def optimizer_state_specs(variables: list[VariableSpec], optimizer: Optimizer,
                          master: bool = False) -> list[VariableSpec]:
    """The ``optim`` group of a unit with these variables (stored or full), named ``<variable>.<state>``.

    The optimizer is asked about each trainable variable's float32 view (it never sees 16-bit); with
    ``master`` each also keeps its float32 master copy, ``<variable>.master``. Frozen variables have none.
    """
    specs = []
    for v in variables:
        if not v.trainable:
            continue
        specs += [VariableSpec(StateName(v.name, s.name), s.shape, s.dtype, s.init)
                  for s in optimizer.state_specs(float32(v))]
        if master:
            specs.append(VariableSpec(StateName(v.name, MASTER), v.shape, torch.float32, Init("zeros")))
    return specs


def unit_groups(placed: dict[str, Placement], optimizer: Optimizer | None, master: bool, stores_grad: bool,
                tied: Collection[str] = (), tied_only: bool = False) -> dict[str, list[VariableSpec]]:
    """The variable groups one rank stores for a unit whose variables are ``placed``, as specs in their
    stored form: its weights (``fwd``); with an ``optimizer``, their optimizer state (``optim``, see
    :func:`optimizer_state_specs`); and where the program stores the unit's gradient between phases
    (``stores_grad``), the gradients of its trainable weights (``grad``; written by each step before it is
    read, so zeros rather than the weights' draws). The gradients of ``tied`` variables (other units use them)
    are float32 whatever the weights' dtype, so that their uses' parts are summed exactly and rounded once;
    with ``tied_only`` the unit stores only theirs (:meth:`ipuft.program.StepProgram.tied_gradients`)."""
    stored = [p.stored_spec() for p in placed.values()]
    groups = {"fwd": stored}
    if optimizer is not None:
        groups["optim"] = optimizer_state_specs(stored, optimizer, master)
        if stores_grad:
            groups["grad"] = [replace(s, init=Init("zeros"), dtype=torch.float32 if s.name in tied else s.dtype)
                              for s in stored if s.trainable and (s.name in tied or not tied_only)]
    return groups


def model_groups(program: StepProgram, placed: dict[str, dict[str, Placement]], optimizer: Optimizer | None,
                 master: bool, host_update: bool) -> dict[Unit, dict[str, list[VariableSpec]]]:
    """Every unit's :func:`unit_groups`, as ``program`` has it: whether the unit stores its gradient between
    phases (:meth:`~ipuft.program.StepProgram.grad_units`), which of its variables others use (tied), and
    whether those are the only gradients it stores (:meth:`~ipuft.program.StepProgram.tied_gradients`)."""
    stores_grad = program.grad_units(host_update)
    tied_only = program.tied_gradients(host_update)
    return {unit: unit_groups(placed[unit.role], optimizer, master, unit in stores_grad,
                              [t.variable for t in program.owned_ties(unit)], unit in tied_only)
            for unit in program.units()}


def initial_values(unit: str, specs: list[VariableSpec], seed: int) -> Tensors:
    """A unit's full initial weights. Random inits draw float32 from a generator seeded by ``seed`` and the
    unit's name, so they depend neither on the number of units nor on the layout, device or precision
    (a 16-bit weight starts as its float32 draw, rounded)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(unit.encode()))
    return {s.name: s.init.fill_(torch.empty(s.shape, dtype=torch.float32), generator).to(s.dtype) for s in specs}
