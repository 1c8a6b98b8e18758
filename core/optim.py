"""The optimizer contract. Optimizers are plugins, chosen with ``training.optimizer.name``.

The engine calls :meth:`Optimizer.step` once per variable per optimizer step, on the device, with the
variable's accumulated gradient (still multiplied by the loss scale) and its optimizer state. The global
gradient norm arrives finished, so clipping is the optimizer's to apply, as in the reference's
``AdamOptimizerStep(loss_scaling, global_norm, global_norm_max)``.

An optimizer only ever sees float32: ``state_specs`` is asked about a variable's float32 view, and ``step``
gets float32 ``weight`` and ``grad`` tensors and writes its float32 result into ``weight``. For 16-bit
weights that ``weight`` is the float32 master copy or a float32 copy of the weight, which the engine then
rounds into it (see :mod:`ipuft.precision`).
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

    ``global_norm`` is the norm of the *unscaled* gradient over every variable of the model;
    ``loss_scaling`` is the factor the gradients still carry; ``step`` counts updates from 1.
    """

    lr: float
    global_norm: float
    loss_scaling: float
    step: int


class Optimizer(ABC):
    """An update rule applied variable by variable, in place."""

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


OptimizerFactory = Callable[["DictConfig"], Optimizer]


class OptimizerRegistry(NamedRegistry):
    """Every optimizer the installed plugins registered (``add(name, build)``, ``build(cfg) -> Optimizer``);
    refuses duplicates."""

    kind = "optimizer"
    key = "training.optimizer.name"
