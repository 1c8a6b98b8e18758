"""``adamw``: the reference's AdamOptimizerStep (popxl-addons), variable by variable.

Core hands over ``g``, the gradient with the loss scale removed and global-norm clipping applied
(``grad · (1/S) · C / max(N, C)``, as the reference's step computes it first); then

    m  = β1·m + (1-β1)·g            v = β2·v + (1-β2)·g²          (float32, bias-corrected)
    u  = m̂ / (√v̂ + eps) + wd·w      wd = 0 where the name contains "norm" or "bias"
    w -= lr · u
"""

from __future__ import annotations

import math

import torch

from ipuft.components import Init, VariableSpec
from ipuft.optim import Optimizer, StepContext

NO_DECAY = ("norm", "bias")
SMALLEST_NORMAL = 2.0**-126  # float32's; its square root 2^-63 is exact


def requires_weight_decay(name: str) -> bool:
    """The reference's rule: no weight decay for layer norms and biases."""
    return not any(word in name for word in NO_DECAY)


class AdamW(Optimizer):
    def __init__(self, beta1: float, beta2: float, eps: float, weight_decay: float):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.weight_decay = weight_decay
        self._eps32 = float(torch.tensor(eps, dtype=torch.float32))  # what add_ adds to float32 (sqrt_floor)

    def state_specs(self, variable: VariableSpec) -> list[VariableSpec]:
        zeros = Init("zeros")
        return [VariableSpec("m", variable.shape, torch.float32, zeros),
                VariableSpec("v", variable.shape, torch.float32, zeros)]

    def sqrt_floor(self, bias2: float) -> float | None:
        """A floor under ``v`` before its square root that changes no denominator ``√v / √bias2 + eps``, or None.

        ATen's CPU ``sqrt`` (MKL's vector math) takes many times as long on an element that is 0 or subnormal
        as on a normal float32 (whatever ``ATEN_CPU_CAPABILITY``; docs/performance.md), and ``v`` is exactly 0
        wherever a variable has had no gradient yet: most of an embedding's rows in fine-tuning (a step's tokens
        touch a few hundred of GPT-J's 50400), whose update then spends much of its time in ``sqrt``.
        Every ``v`` up to the smallest normal float32, 2^-126,
        gives the denominator ``eps`` itself where ``2^-63 / √bias2`` (rounded) is under half an ulp of ``eps``:
        then ``v`` is clamped to 2^-126 first, and the denominators are those of ``sqrt(v)``, bit for bit. Half an
        ulp of a normal float32 ``eps`` is at least ``eps·2^-25``, and ``2^-62 / √bias2`` bounds the rounded
        quotient, so ``eps·√bias2 ≥ 2^-37`` is enough: with the default ``eps`` 1e-6 and β2 0.999 it holds from
        the first step, when ``√bias2`` is smallest (0.032)."""
        return SMALLEST_NORMAL if self._eps32 * math.sqrt(bias2) >= 2.0**-37 else None

    @torch.no_grad()
    def step(self, name: str, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             ctx: StepContext) -> None:
        m, v = state["m"], state["v"]
        m.lerp_(grad, 1.0 - self.beta1)  # β1·m + (1-β1)·g
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        bias1 = 1.0 - self.beta1**ctx.step
        bias2 = 1.0 - self.beta2**ctx.step
        # m̂ / (√v̂ + eps) = (m / bias1) / (√v / √bias2 + eps), without materialising m̂ and v̂.
        floor = self.sqrt_floor(bias2)
        denom = v.sqrt() if floor is None else v.clamp_min(floor).sqrt_()
        denom = denom.div_(math.sqrt(bias2)).add_(self.eps)
        if self.weight_decay and requires_weight_decay(name):
            weight.mul_(1.0 - ctx.lr * self.weight_decay)  # w - lr·wd·w, on the weight before the step
        weight.addcdiv_(m, denom, value=-ctx.lr / bias1)  # float32: core maps it into a 16-bit weight

    @torch.no_grad()
    def step_unit(self, names: list[str], weights: list[torch.Tensor], grads: list[torch.Tensor],
                  states: list[dict[str, torch.Tensor]], ctx: StepContext) -> None:
        """:meth:`step` for every variable of a unit at once, with multi-tensor ops: the same arithmetic, in
        the same order, element by element (one fused kernel per op on CUDA, one call per op on the CPU).
        torch's single-kernel ``_fused_adamw_`` gives the same m and v but rounds the weight update
        differently in the last bit (6 of 4096 weights after one step), so it is not used."""
        if not names:
            return
        ms, vs = [s["m"] for s in states], [s["v"] for s in states]
        torch._foreach_lerp_(ms, grads, 1.0 - self.beta1)
        torch._foreach_mul_(vs, self.beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - self.beta2)
        bias1 = 1.0 - self.beta1**ctx.step
        bias2 = 1.0 - self.beta2**ctx.step
        floor = self.sqrt_floor(bias2)
        if floor is None:
            denoms = torch._foreach_sqrt(vs)
        else:
            denoms = torch._foreach_clamp_min(vs, floor)
            torch._foreach_sqrt_(denoms)
        torch._foreach_div_(denoms, math.sqrt(bias2))
        torch._foreach_add_(denoms, self.eps)
        decayed = [w for name, w in zip(names, weights, strict=True) if requires_weight_decay(name)]
        if self.weight_decay and decayed:
            torch._foreach_mul_(decayed, 1.0 - ctx.lr * self.weight_decay)
        torch._foreach_addcdiv_(weights, ms, denoms, value=-ctx.lr / bias1)
