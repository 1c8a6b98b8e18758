"""``adamw``: the reference's AdamOptimizerStep (popxl-addons), variable by variable.

Core hands over ``g``, the gradient with the loss scale removed and global-norm clipping applied
(``grad · (1/S) · C / max(N, C)``, as the reference's step computes it first); then

    m  = β1·m + (1-β1)·g            v = β2·v + (1-β2)·g²          (float32, bias-corrected)
    u  = m̂ / (√v̂ + eps) + wd·w      wd = 0 where the name contains "norm" or "bias"
    w -= lr · u

in one pass over memory where the one-pass kernel serves (:mod:`ipuft.engine.fused`, :meth:`AdamW.fused_step`),
and otherwise in torch ops with the same float32 operations, so bit for bit the same.
"""

from __future__ import annotations

import math

import torch

from ipuft.components import Init, VariableSpec
from ipuft.engine import fused
from ipuft.engine.fused import Hyper
from ipuft.optim import Optimizer, StepContext

NO_DECAY = ("norm", "bias")
SMALLEST_NORMAL = 2.0**-126  # float32's; its square root 2^-63 is exact


def requires_weight_decay(name: str) -> bool:
    """The reference's rule: no weight decay for layer norms and biases."""
    return not any(word in name for word in NO_DECAY)


def sqrt_(x: torch.Tensor) -> torch.Tensor:
    """``x``'s square roots in place, correctly rounded, as the one-pass kernel's ``sqrtf`` and CUDA's ``sqrt``
    round them. ATen's CPU ``sqrt`` (MKL's vector math, high-accuracy mode) is within an ulp, and off by one in
    about a sixth of the elements: each root ``s`` moves to the float32 neighbour whose square's interval holds
    ``x``, decided exactly in float64 (a float32 midpoint has 25 significant bits, its square 50)."""
    x.sqrt_() if x.device.type != "cpu" else _correct_sqrt_(x)
    return x


def _correct_sqrt_(x: torch.Tensor) -> None:
    wide = x.double()
    root = x.sqrt_()
    for toward in (float("inf"), 0.0):  # an ulp too low, then an ulp too high
        other = torch.nextafter(root, torch.tensor(toward))
        midpoint = (root.double() + other.double()) * 0.5
        past = wide > midpoint.square() if toward else wide < midpoint.square()
        root.copy_(torch.where(past & (other != root), other, root))


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

    def scalars(self, name: str, ctx: StepContext, factor: float = 1.0) -> Hyper:
        """Variable ``name``'s scalars of the update ``ctx`` (the one-pass kernel's, and the ops'): the
        gradient's ``factor``, the betas, the bias correction ``√bias2`` (the step's ``-lr / bias1``), the floor
        under ``v`` (0: none) and the decoupled decay's factor (1 where the no-decay rule says so)."""
        bias1 = 1.0 - self.beta1**ctx.step
        bias2 = 1.0 - self.beta2**ctx.step
        decay = 1.0 - ctx.lr * self.weight_decay if self.weight_decay and requires_weight_decay(name) else 1.0
        return Hyper(factor=factor, beta1=self.beta1, one_minus_beta1=1.0 - self.beta1, beta2=self.beta2,
                     one_minus_beta2=1.0 - self.beta2, sqrt_bias2=math.sqrt(bias2), eps=self.eps,
                     floor=self.sqrt_floor(bias2) or 0.0, decay=decay, step=-ctx.lr / bias1)

    @torch.no_grad()
    def step(self, name: str, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             ctx: StepContext) -> None:
        """The update in torch ops, each rounded once, in the one-pass kernel's order (:mod:`ipuft.engine.fused`):
        ``m = m·β1 + g·(1-β1)``, ``v = v·β2 + (g·g)·(1-β2)``, ``d = √max(v, floor) / √bias2 + eps``,
        ``w = w·(1 - lr·wd) + (m / d)·(-lr / bias1)``."""
        self.step_unit([name], [weight], [grad], [state], ctx)

    @torch.no_grad()
    def step_unit(self, names: list[str], weights: list[torch.Tensor], grads: list[torch.Tensor],
                  states: list[dict[str, torch.Tensor]], ctx: StepContext) -> None:
        """:meth:`step` for every variable of a unit at once, with multi-tensor ops: the same arithmetic, in
        the same order, element by element (one kernel per op on CUDA, one call per op on the CPU)."""
        if not names:
            return
        h = self.scalars(names[0], ctx)  # all but the decay (below) are every variable's
        ms, vs = [s["m"] for s in states], [s["v"] for s in states]
        torch._foreach_mul_(ms, h.beta1)
        torch._foreach_add_(ms, torch._foreach_mul(grads, h.one_minus_beta1))
        squares = torch._foreach_mul(grads, grads)
        torch._foreach_mul_(squares, h.one_minus_beta2)
        torch._foreach_mul_(vs, h.beta2)
        torch._foreach_add_(vs, squares)
        denoms = torch._foreach_clamp_min(vs, h.floor) if h.floor else [v.clone() for v in vs]
        for d in denoms:
            sqrt_(d)
        torch._foreach_div_(denoms, h.sqrt_bias2)
        torch._foreach_add_(denoms, h.eps)
        decayed = [w for name, w in zip(names, weights, strict=True) if requires_weight_decay(name)]
        if self.weight_decay and decayed:
            torch._foreach_mul_(decayed, 1.0 - ctx.lr * self.weight_decay)
        steps = torch._foreach_div(ms, denoms)
        torch._foreach_mul_(steps, h.step)
        torch._foreach_add_(weights, steps)

    @torch.no_grad()
    def fused_step(self, names: list[str], weights: list[torch.Tensor], grads: list[torch.Tensor],
                   states: list[dict[str, torch.Tensor]], ctx: StepContext,
                   roundings: list[tuple[int, int | torch.Tensor] | None]) -> bool:
        """The update of a group of pieces in one pass each (:mod:`ipuft.engine.fused`), from the stored weights
        and the gradients before ``ctx.grad_factor``: :meth:`step`'s arithmetic and, for a 16-bit weight, its
        stochastic rounding ``(key, counters)`` bit for bit. False, having changed nothing, where the kernel does
        not serve every piece (the engine then runs the ops)."""
        if not all(fused.serves(w, g, r) for w, g, r in zip(weights, grads, roundings, strict=True)):
            return False
        for name, w, g, s, r in zip(names, weights, grads, states, roundings, strict=True):
            fused.adamw_(w, g, s["m"], s["v"], self.scalars(name, ctx, ctx.grad_factor), r)
        return True
