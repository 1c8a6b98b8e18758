"""``adamw8bit``: ``adamw``'s update with its moments stored in 8 bits, block-wise (:mod:`.quantize`).

Each step of a piece of a variable dequantizes its ``m`` and ``v`` to float32, runs
:class:`ipuft_optim_adam.adamw.AdamW`'s own arithmetic on them (the same bias correction, ``eps``, decoupled
decay and no-decay rule, on the gradient core has finished and clipped), updates the weight from those float32
moments and stores them again, each as uint8 codes with a float32 absmax per block of ``block_size``
elements: 2 + 8 / ``block_size`` bytes of state per parameter instead of 8.

Norms and biases (the names the no-decay rule names: a few thousand elements a layer, where 8-bit state
saves nothing worth a quantization error on the variables that scale activations) keep float32 ``m`` and
``v``, as bitsandbytes keeps tensors under its ``min_8bit_size``; the choice goes by name, not size, so that
it is the same whatever slice of the variable a rank stores.
"""

from __future__ import annotations

import math

import torch

from ipuft.components import Init, VariableSpec
from ipuft.engine import compiled, fused
from ipuft.optim import StepContext
from ipuft_optim_adam.adamw import AdamW, requires_weight_decay
from ipuft_optim_adamw8bit import compiled as compiled8
from ipuft_optim_adamw8bit.quantize import Codebook, dequantize, quantize_

ABSMAX = {"m": "m_absmax", "v": "v_absmax"}


def quantized(name: str) -> bool:
    """Whether variable ``name`` keeps 8-bit moments (all but norms and biases)."""
    return requires_weight_decay(name)


class AdamW8bit(AdamW):
    block_states = frozenset(ABSMAX.values())

    def __init__(self, beta1: float, beta2: float, eps: float, weight_decay: float, block_size: int):
        super().__init__(beta1, beta2, eps, weight_decay)
        self.block_size = block_size
        self.books = {"m": Codebook(signed=True), "v": Codebook(signed=False)}

    def state_specs(self, variable: VariableSpec) -> list[VariableSpec]:
        """uint8 ``m`` and ``v`` shaped like the variable (so they are sliced as it is), and one float32 absmax
        per block of its flat form, ``m_absmax`` and ``v_absmax``; float32 ``m`` and ``v`` for norms and biases."""
        if not quantized(variable.name):
            return super().state_specs(variable)
        zeros, blocks = Init("zeros"), (math.ceil(variable.numel / self.block_size),)
        return [VariableSpec("m", variable.shape, torch.uint8, zeros),
                VariableSpec("v", variable.shape, torch.uint8, zeros),
                VariableSpec(ABSMAX["m"], blocks, torch.float32, zeros),
                VariableSpec(ABSMAX["v"], blocks, torch.float32, zeros)]

    def _moments(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Float32 ``m`` and ``v`` of a piece: its state itself when float32, else dequantized."""
        if state["m"].dtype != torch.uint8:
            return state
        return {k: dequantize(state[k], state[ABSMAX[k]], self.books[k], self.block_size) for k in ABSMAX}

    def _store(self, state: dict[str, torch.Tensor], moments: dict[str, torch.Tensor]) -> None:
        if moments is not state:
            for k in ABSMAX:
                quantize_(state[k], state[ABSMAX[k]], moments[k], self.books[k], self.block_size)

    @torch.no_grad()
    def step(self, name: str, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             ctx: StepContext) -> None:
        moments = self._moments(state)
        super().step(name, weight, grad, moments, ctx)
        self._store(state, moments)

    @torch.no_grad()
    def step_unit(self, names: list[str], weights: list[torch.Tensor], grads: list[torch.Tensor],
                  states: list[dict[str, torch.Tensor]], ctx: StepContext) -> None:
        """:meth:`step` for a group of pieces, ``adamw``'s multi-tensor arithmetic between one dequantization and
        one quantization of each piece (each piece starts on a block boundary: the engine cuts at multiples of
        :attr:`block_size`)."""
        moments = [self._moments(s) for s in states]
        super().step_unit(names, weights, grads, moments, ctx)
        for state, wide in zip(states, moments, strict=True):
            self._store(state, wide)

    @torch.no_grad()
    def fused_step(self, names: list[str], weights: list[torch.Tensor], grads: list[torch.Tensor],
                   states: list[dict[str, torch.Tensor]], ctx: StepContext,
                   roundings: list[tuple[int, int | torch.Tensor] | None]) -> bool:
        """:meth:`step_unit` in one pass per piece (:mod:`ipuft.engine.fused`; on CUDA :mod:`.compiled`): each
        block's codes decoded, ``adamw``'s arithmetic, the weight stored (rounded stochastically when 16-bit) and
        the block quantized again, bit for bit as the ops do it; the float32-moment pieces (norms, biases) as
        ``adamw``'s."""
        if not all(fused.serves(w, g, r) and (compiled.routes(w.device) or self.block_size <= fused.MAX_BLOCK)
                   for w, g, r in zip(weights, grads, roundings, strict=True)):
            return False
        for name, w, g, s, r in zip(names, weights, grads, states, roundings, strict=True):
            scalars = self.scalars(name, ctx, ctx.grad_factor)
            if s["m"].dtype != torch.uint8:
                fused.adamw_(w, g, s["m"], s["v"], scalars, r)
                continue
            update = compiled8.adamw8bit_ if fused.by_compiled(w.device) else fused.adamw8bit_
            update(w, g, {k: s[k] for k in ABSMAX}, {k: s[a] for k, a in ABSMAX.items()},
                   {k: self.books[k].tables(w.device) for k in ABSMAX}, self.block_size, scalars, r)
        return True
