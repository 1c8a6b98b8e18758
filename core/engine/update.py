"""The update: a unit's optimizer step in pieces, its placement (on the device, or in host memory), and the
mapping of updated float32 values back into 16-bit weights.

:class:`UnitUpdate` finishes every gradient of a unit (the loss scale removed, global-norm clipping applied,
in float32) and hands it to the optimizer (the optimizer contract, :mod:`ipuft.optim`) piece by piece; how
the pieces are cut and what each call adds on the device are shared with ``ipuft plan``.
"""

from __future__ import annotations

import torch

from ipuft.engine.cuts import call_chunk, group_transient_bytes, piece_multiple, update_groups
from ipuft.engine.store import Tensors
from ipuft.engine.variables import MASTER
from ipuft.optim import StepContext, has_fused_step, state_piece
from ipuft.precision import Recipe, rounding_key, stochastic_round_
from ipuft.program import Phase


def _piece(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t.view(-1)[start:stop]


class UnitUpdate:
    """Updates one unit's trainable variables at a time, for a :class:`~ipuft.engine.stored.StoredModel`."""

    def __init__(self, model) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.recipe = model.recipe
        self.store = model.store
        self.clipping = model.cfg.training.optimizer.gradient_clipping
        self.seed = model.cfg.model.seed

    def context(self, lr: float, step: int, grad_norm: float, loss_scale: float) -> StepContext:
        """What every unit's update in one optimizer step shares: the gradients' factor removes the loss scale and
        clips to the global norm."""
        factor = (1.0 / loss_scale) * self.clipping / max(grad_norm, self.clipping)
        return StepContext(lr=lr, step=step, global_norm=grad_norm, grad_factor=factor)

    def step(self, phase: Phase, weights: Tensors, optim: Tensors, grads: Tensors, ctx: StepContext) -> None:
        """Update ``phase``'s unit from its finished gradients, piece by piece.

        An elementwise optimizer gets the unit's variables cut into pieces of at most :func:`update_chunk`
        elements, grouped so that each call updates about that many: the update's temporaries (the
        optimizer's own, the float32 views of 16-bit weights, the rounding's) stay that small, where the
        whole of a GPT-J-6B-wide embedding would make each of them 0.8 GB, and on the CPU the working set of
        one call stays in cache. Each element's arithmetic is the same, so the results are those of one call
        over whole variables. Any other optimizer gets whole variables, one at a time."""
        states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in weights}
        for key, t in optim.items():
            states[key.variable][key.state] = t
        sizes = [(name, weights[name].numel()) for name in weights if name in grads]  # frozen: no gradient
        device = next(iter(weights.values())).device if weights else self.model.device
        for group in update_groups(sizes, call_chunk(self.optimizer, device), self.multiple):
            self.pieces(phase, group, [_piece(weights[n], a, b) for n, a, b in group],
                        [_piece(grads[n], a, b) for n, a, b in group],
                        [{k: state_piece(self.optimizer, k, t, a, b) for k, t in states[n].items()}
                         for n, a, b in group], ctx)

    @property
    def multiple(self) -> int:
        return piece_multiple(self.optimizer)

    def in_host_memory(self, phase: Phase, ctx: StepContext) -> None:
        """``execution.optimizer_placement=host``: update the unit where its variables live, in place in host
        memory, from its stored gradient (the phase has just stored the gradient it computed). Nothing
        crosses to the device; the weights come back when the next step's phases load them.

        A worker thread could run these updates while the device works, but in the reference's program
        nothing computes after the global norm, which every update needs: the host updates run in turn,
        each using the CPU's intra-op threads."""
        self.store.synchronize()  # the gradients' device→host copies have landed (CUDA)
        entries = self.store.entries[phase.unit]
        trainable = self.model.trainable[phase.role]
        weights = {n: t for n, t in entries["fwd"].items() if n in trainable}
        with self.store.on_host():
            self.step(phase, weights, entries["optim"], entries["grad"], ctx)

    def pieces(self, phase: Phase, group: list[tuple[str, int, int]], weights: list[torch.Tensor],
               grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]], ctx: StepContext) -> None:
        """One optimizer call over ``group``'s pieces ``(variable, start, stop)`` of flat elements, given as the
        pieces themselves (flat slices of the weights, their gradients and their state, wherever they are: the
        stored tensors, or copies streamed to the device, :mod:`ipuft.engine.streaming`). The optimizer sees
        float32: a 16-bit weight's view is its master copy or a float32 copy, mapped back into the weight by
        the run's recipe (see :mod:`ipuft.precision`). Gradients are consumed: a float32 one is finished
        in place.

        Where the optimizer has a one-pass update (``fused_step``, :mod:`ipuft.engine.fused`: the C kernel on the
        CPU, the compiled one on CUDA) and the recipe is float32 or stochastic rounding, that does it all (the
        factor, the rule, the rounding) and nothing here runs; it gives these ops' results bit for bit."""
        if self._fused(phase, group, weights, grads, states, ctx):
            return
        wide = self.recipe is not Recipe.exact
        transient = group_transient_bytes(self.recipe, [stop - start for _, start, stop in group])
        self.store.hold(transient)
        names, views, finished, pieces = [], [], [], []
        for (name, _, _), weight, grad, given in zip(group, weights, grads, states, strict=True):
            state = dict(given)
            master = state.pop(MASTER, None)
            names.append(f"{phase.unit}.{name}")
            views.append(weight if not wide else master if master is not None else weight.float())
            finished.append(grad.float())
            pieces.append(state)
        torch._foreach_mul_(finished, ctx.grad_factor)
        self.optimizer.step_unit(names, views, finished, pieces, ctx)
        if wide:
            for (name, start, _), weight, view in zip(group, weights, views):
                self._round_into(phase, name, weight, view, start, ctx.step)
        self.store.free(transient)

    def _fused(self, phase: Phase, group: list[tuple[str, int, int]], weights: list[torch.Tensor],
               grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]], ctx: StepContext) -> bool:
        """The group's update by the optimizer's one-pass ``fused_step``, where it has one that serves: the
        stored pieces, the gradients before the factor, and each piece's stochastic rounding (its key, and its
        elements' counters in the full variable) when 16-bit."""
        if not has_fused_step(self.optimizer) or self.recipe not in (Recipe.exact, Recipe.stochastic) or not weights:
            return False
        roundings = [None] * len(group)
        if self.recipe is Recipe.stochastic:
            roundings = [(rounding_key(self.seed, phase.unit, name, ctx.step),
                          self.model.placed[phase.role][name].counters(start, stop - start, weight.device))
                         for (name, start, stop), weight in zip(group, weights, strict=True)]
        names = [f"{phase.unit}.{name}" for name, _, _ in group]
        return self.optimizer.fused_step(names, weights, grads, states, ctx, roundings)

    def _round_into(self, phase: Phase, name: str, weight: torch.Tensor, view: torch.Tensor, start: int,
                    step: int) -> None:
        """Map the updated float32 ``view`` back into the 16-bit ``weight`` (elements ``start …`` of the
        variable's stored form) by the run's recipe: stochastic rounding keyed on each element's index in the
        full variable, or to nearest (a master copy is cast, as it is)."""
        if self.recipe is not Recipe.stochastic:
            weight.copy_(view)
            return
        key = rounding_key(self.seed, phase.unit, name, step)
        placed = self.model.placed[phase.role][name]
        stochastic_round_(weight, view, key, lambda first, count: placed.counters(start + first, count, weight.device))
