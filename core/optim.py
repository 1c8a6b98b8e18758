"""The optimizer contract. Optimizers are plugins, chosen with ``training.optimizer.name``; their
hyperparameters live in their own config section (``plugins.<section>``).

The engine calls :meth:`Optimizer.step` once per variable per optimizer step, on the device, with the
variable's gradient already finished: averaged over micro-batches and DP replicas, the loss scale
removed and global-norm clipping applied (``grad · (1/S) · C / max(N, C)``, S the loss scale, N the global
norm of the unscaled gradient, C ``training.optimizer.gradient_clipping``), as the reference's
``AdamOptimizerStep`` computes it first. An optimizer applies its own rule and nothing else.

An optimizer only ever sees float32: ``state_specs`` is asked about a variable's float32 view, and ``step``
gets float32 ``weight`` and ``grad`` tensors and writes its float32 result into ``weight``. For 16-bit
weights that ``weight`` is the float32 master copy or a float32 copy of the weight, which the engine then
rounds into it (see :mod:`ipuft.engine.precision`).

An optimizer is *elementwise* (the default) when each element's update depends only on that element's
gradient and state, as Adam's and SGD's do: it may then see any slice of a variable, in particular the
flat 1-D shard a rank stores with RTS. One that is not (factored or per-row state, per-tensor norms)
registers with ``elementwise=False``: it sees each variable in its TP-local shape, its state must be
shaped like the variable when TP > 1 (so that checkpoints stay layout-free), and RTS is refused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipuft.components import VariableSpec
from ipuft.registry import NamedRegistry

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig


@dataclass(frozen=True)
class StepContext:
    """What every variable's update of one optimizer step shares.

    ``step`` counts updates from 1. ``global_norm`` is the norm of the unscaled, unclipped gradient over
    every variable of the model, and ``grad_factor`` the factor core already applied to every gradient
    (loss-scale removal times clipping); both are for information: the gradient is finished.
    """

    lr: float
    step: int
    global_norm: float
    grad_factor: float


class Optimizer(ABC):
    """An update rule applied variable by variable, in place."""

    #: Set by core from the optimizer's registration (``elementwise=``); the engine then hands it pieces of
    #: variables of its choosing (see :meth:`step_unit`) rather than whole ones.
    elementwise: bool = True

    #: Where the pieces an elementwise optimizer is called with may start: every piece begins at a multiple of
    #: this many elements of its flattened variable (its stored form: the TP shard, or with RTS the rank's flat
    #: slice), for state kept per block of elements (an 8-bit optimizer's per-block scales). A piece may end
    #: anywhere at its variable's end. The engine's pieces (:func:`ipuft.engine.update.update_groups`, the
    #: streamed update's included) honour it; 1 by default.
    piece_multiple: int = 1

    @abstractmethod
    def state_specs(self, variable: VariableSpec) -> list[VariableSpec]:
        """The optimizer-state variables kept for ``variable`` (names local to it, e.g. ``m``, ``v``)."""

    @abstractmethod
    def step(
        self,
        name: str,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        ctx: StepContext,
    ) -> None:
        """Update ``weight`` and ``state`` in place from ``grad``; ``name`` is the variable's full name."""

    def step_unit(
        self,
        names: list[str],
        weights: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        ctx: StepContext,
    ) -> None:
        """Update every trainable variable of one unit at once (float32, as :meth:`step`). The default calls
        :meth:`step` per variable; an optimizer may override it with multi-tensor ops (``torch._foreach_*``),
        one call per op for the whole unit instead of one per variable, with the same results.

        An elementwise optimizer is called with pieces: flat slices of the unit's variables (and of their state),
        each under its variable's name, a few hundred thousand elements per call on the CPU (so that they stay
        in cache across the update's passes), a few million on a GPU; a variable larger than that comes in
        several calls."""
        for name, weight, grad, state in zip(names, weights, grads, states, strict=True):
            self.step(name, weight, grad, state, ctx)


OptimizerFactory = Callable[["DictConfig"], Optimizer]


class OptimizerRegistry(NamedRegistry):
    """Every optimizer the installed plugins registered: ``add(name, build, description, elementwise=True)``,
    with ``build(cfg) -> Optimizer``."""

    kind = "optimizer"
    key = "training.optimizer.name"

    def add(self, name: str, build: OptimizerFactory, description: str = "", elementwise: bool = True) -> None:
        """Register optimizer ``name``; ``elementwise=False`` for an update that needs whole tensors (see
        :mod:`ipuft.optim`)."""
        super().add(name, build, description, elementwise=bool(elementwise))

    def elementwise(self, name: str) -> bool:
        return self.get(name).options.get("elementwise", True)
