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
rounds into it (see :mod:`ipuft.precision`).

An optimizer is *elementwise* (the default) when each element's update depends only on that element's
gradient and state, as Adam's and SGD's do: it may then see any slice of a variable, in particular the
flat 1-D shard a rank stores with RTS. One that is not (factored or per-row state, per-tensor norms)
registers with ``elementwise=False``: it sees each variable in its TP-local shape, its state must be
shaped like the variable when TP > 1 (so that checkpoints stay layout-free), and RTS is refused.

An elementwise optimizer may keep *block-wise* state (a quantized state's per-block scales): it sets
:attr:`Optimizer.block_size` and names that state in :attr:`Optimizer.block_states`. The engine then cuts
update pieces and RTS slices of its variables only at multiples of ``block_size`` elements, so every piece
and every rank's slice is whole blocks of its variable's flat form (the last block of a variable may be
partial), and a block state holds one element per block: :func:`state_piece` is the part a piece sees.
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
    #: Elements per block of block-wise state (see the module's docstring); 1: none. Every piece an elementwise
    #: optimizer is called with then starts at a multiple of it in its flattened variable (its stored form: the
    #: TP shard, or with RTS the rank's flat slice, itself cut on a multiple of it), and may end anywhere at the
    #: variable's end: the engine's pieces (:func:`ipuft.engine.cuts.update_groups`, the streamed update's
    #: included) honour it.
    block_size: int = 1
    #: The names of the state variables (``state_specs``) that hold one element per block, 1-D.
    block_states: frozenset[str] = frozenset()

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

    def fused_step(
        self,
        names: list[str],
        weights: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        ctx: StepContext,
        roundings: list[tuple[int, int | torch.Tensor] | None],
    ) -> bool:
        """Optional: the update of a group of pieces in one pass over memory each (:mod:`ipuft.engine.fused`),
        from the stored weights (16-bit ones too) and the gradients before ``ctx.grad_factor``, with each 16-bit
        piece's stochastic rounding ``(key, counters)``: :meth:`step`'s arithmetic, bit for bit. Returns whether
        it did; False, having changed nothing, hands the group to :meth:`step_unit`. An optimizer that overrides
        it has one (:func:`has_fused_step`); this default has none."""
        return False


def has_fused_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s class overrides :meth:`Optimizer.fused_step` (the plan counts such calls as
    making no float32 views)."""
    return type(optimizer).fused_step is not Optimizer.fused_step


def state_piece(optimizer: Optimizer, state: str, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The part of ``tensor``, a variable's optimizer state ``state``, that goes with the variable's flat elements
    ``start … stop-1``: those elements, or for a block state the blocks that hold them (``start`` is on a block
    boundary, see :attr:`Optimizer.block_size`)."""
    flat = tensor.view(-1)
    if state not in optimizer.block_states:
        return flat[start:stop]
    block = optimizer.block_size
    return flat[start // block : -(-stop // block)]


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
