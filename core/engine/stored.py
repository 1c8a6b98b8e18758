"""The model in the store: every unit's variables as this rank keeps them, and their full views.

:class:`StoredModel` is what training (:class:`~ipuft.engine.phased.PhasedEngine`) and inference
(:class:`~ipuft.engine.inference.LayerMajor`) share: the components, each variable's placement, the
:class:`~ipuft.engine.store.VariableStore` filled unit by unit, the unit's weights gathered into the form a
phase computes with, and the checkpoints' layout-free views of weights and optimizer state. A model built
without an optimizer stores the weights only (no optimizer state, no gradients): it is for forward passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from omegaconf import DictConfig

from ipuft.components import VariableSpec
from ipuft.engine.cuts import step_shape
from ipuft.engine.model import ModelParts
from ipuft.engine.placement import Placement
from ipuft.engine.store import Tensors, VariableStore, nbytes
from ipuft.engine.variables import (
    MASTER,
    Initializer,
    float32,
    initial_values,
    model_groups,
    optimizer_state_specs,
    placements,
)
from ipuft.hostmem import retain_freed_memory
from ipuft.optim import Optimizer
from ipuft.parallel import Layout, active
from ipuft.precision import Recipe, compute_dtype, recipe
from ipuft.program import Unit


class StoredModel:
    """One rank's store of a model's variables, allocated and initialised unit by unit."""

    def __init__(self, cfg: DictConfig, parts: ModelParts, device: torch.device | str,
                 layout: Layout | None = None, optimizer: Optimizer | None = None,
                 initializer: Initializer | None = None) -> None:
        """``initializer(unit, specs)`` gives a unit's full initial weights (default: random, seeded by
        ``model.seed``). With an ``optimizer`` the store also holds its state and, where the program stores
        them between phases, the gradients; the modules are then in training mode."""
        self.cfg = cfg
        self.parts = parts
        self.program = parts.program
        self.modules = parts.modules
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.layout = layout or active()
        self.placed = placements(parts, self.layout, bool(cfg.execution.rts), optimizer)
        # Each role's own trainable variables: the only ones with gradients, optimizer state and updates.
        self.trainable = {role: {v.name for v in specs if v.trainable} for role, specs in parts.variables.items()}
        # What each role computes with: its own variables' placements and its tied ones' (their owners'), and
        # the trainable ones among them, whose gradients a backward computes.
        self.uses = {role: {**placed, **{t.name: self.placed[t.owner.role][t.variable]
                                         for t in self.program.used_ties(role)}}
                     for role, placed in self.placed.items()}
        self.differentiated = {role: names | {t.name for t in self.program.used_ties(role) if t.trainable}
                               for role, names in self.trainable.items()}
        self.dtype = compute_dtype(cfg)
        self.recipe = recipe(cfg)
        self.host_update = step_shape(cfg).host_update and optimizer is not None
        if cfg.execution.retain_host_memory:
            retain_freed_memory(cfg.model.hidden_size)
        self.store = VariableStore(self.device, offload=cfg.execution.offload)
        for module in self.modules.values():
            module.train(optimizer is not None)
        self._allocate(initializer or (lambda unit, specs: initial_values(unit, specs, cfg.model.seed)))

    def _allocate(self, initializer: Initializer) -> None:
        """Fill the store unit by unit with the groups :func:`~ipuft.engine.variables.model_groups` says it holds:
        the weights from ``initializer`` (one unit's full float32 weights at a time, so a rank never holds more
        besides its store; a master copy starts from them; the store keeps the weights' dtype), the optimizer
        state and the gradients allocated."""
        master = self.recipe is Recipe.master
        stored_groups = model_groups(self.program, self.placed, self.optimizer, master, self.host_update)
        for unit, groups in stored_groups.items():
            placed = self.placed[unit.role]
            full = initializer(unit, [float32(v) for v in self.parts.variables[unit.role]])
            wide = {n: placed[n].to_stored(t) for n, t in full.items()}
            del full
            self.store.put(unit, "fwd", {s.name: wide[s.name].to(s.dtype) for s in groups["fwd"]})
            for group in ("optim", "grad"):
                if group in groups:
                    self.store.allocate(unit, group, groups[group])
            if master:
                for spec in groups["optim"]:
                    if spec.name.state == MASTER:
                        self.store.entries[unit]["optim"][spec.name].copy_(wide[spec.name.variable])

    @contextmanager
    def gathered(self, role: str, stored: Tensors) -> Iterator[Tensors]:
        """A unit's weights in the local form to compute with (gathered over DP where RTS slices them), counted
        on the device for the block (``stored`` may hold the tied variables the unit uses, its owners')."""
        placed = self.uses[role]
        weights = {n: placed[n].gather(t) for n, t in stored.items()}
        with self.store.holding(nbytes(w for n, w in weights.items() if w is not stored[n])):
            yield weights

    def borrow(self, role: str) -> Tensors:
        """The tied variables a unit of ``role`` computes with, loaded from their owners (as ``fwd`` traffic), by
        the names the unit uses; the phase releases them as it releases what it loaded."""
        return {t.name: self.store.load(t.owner, "fwd", [t.variable])[t.variable]
                for t in self.program.used_ties(role)}

    # ---- whole-model views (checkpoints, export) ----

    def weights(self) -> dict[str, Tensors]:
        """Every unit's weights as this rank stores them (host tensors when offloaded)."""
        return self.store.state("fwd")

    def _placement(self, unit: Unit, group: str, name: str) -> Placement:
        """The placement of ``name`` in ``group``; optimizer state (a :class:`~ipuft.engine.variables.StateName`)
        is placed like its variable, a block state block for block (:meth:`Placement.blocks`)."""
        if group != "optim":
            return self.placed[unit.role][name]
        placed = self.placed[unit.role][name.variable]
        if name.state in self.optimizer.block_states:
            return placed.blocks(self.optimizer.block_size)
        return placed

    def full_specs(self, unit: Unit, group: str = "fwd") -> list[VariableSpec]:
        """The full (layout-free) specs of ``unit``'s ``group`` (``fwd`` or ``optim``) in their stored dtypes,
        in the order :meth:`full_tensors` gives them (and checkpoints hold them)."""
        variables = self.parts.variables[unit.role]
        if group == "fwd":
            return list(variables)
        return optimizer_state_specs(variables, self.optimizer, self.recipe is Recipe.master)

    def full_tensors(self, groups: Sequence[str] = ("fwd",)) -> Iterator[tuple[Unit, str, VariableSpec, torch.Tensor]]:
        """Every unit's full variables of ``groups`` as ``(unit, group, full spec, tensor)``, one at a time:
        units in program order, each unit's groups in turn, each in :meth:`full_specs` order.

        Each tensor is gathered over DP and TP only when it is reached, so a rank holds about one full tensor
        beyond its store at a time. Every rank must exhaust the iterator, in step: each tensor is a collective.
        A variable no rank shares comes back as stored (no copy on CPU): use it before the next step.
        """
        self.store.synchronize()
        for unit in self.program.units():
            for group in groups:
                stored = self.store.entries[unit][group]
                for spec in self.full_specs(unit, group):
                    placement = self._placement(unit, group, spec.name)
                    tensor = stored[spec.name]
                    if placement.collective:
                        tensor = placement.full(tensor.to(self.device))
                    yield unit, group, spec, tensor.cpu()

    def full_weights(self, group: str = "fwd") -> dict[str, Tensors]:
        """Every unit's full weights (or, with ``group="optim"``, optimizer state, named
        ``<variable>.<state>``), gathered over DP and TP, as copies. Every rank must call it."""
        out: dict[str, Tensors] = {}
        for unit, _, spec, tensor in self.full_tensors([group]):
            stored = self.store.entries[unit][group][spec.name]
            out.setdefault(unit, {})[spec.name] = tensor.clone() if tensor is stored else tensor
        return out

    def load_full(self, group: str, units: dict[Unit, Tensors]) -> None:
        """Replace ``group`` of every unit from full tensors (a checkpoint's), in this rank's stored form."""
        for unit, tensors in units.items():
            stored = self.store.entries[unit][group]
            for n, t in tensors.items():
                if t is not stored[n]:  # else read into place already (see full_homes)
                    stored[n].copy_(self._placement(unit, group, n).to_stored(t))

    def full_homes(self, unit: Unit, group: str) -> Tensors:
        """The stored tensors of ``unit``'s ``group`` that are their full variable (no rank shares them) and
        live in host memory: a checkpoint can be read straight into them."""
        return {n: t for n, t in self.store.entries[unit][group].items()
                if not self._placement(unit, group, n).collective and t.device.type == "cpu" and t.is_contiguous()}
