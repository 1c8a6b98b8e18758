"""The Lion update, variable by variable (Chen et al. 2023, Algorithm 2).

Core hands over ``g``, the finished gradient (loss scale removed, global-norm clipping applied), in float32;
then, with one float32 state ``m`` per variable (zeros at the start):

    c  = β1·m + (1-β1)·g
    w -= lr · (sign(c) + wd·w)          wd = 0 where the name contains "norm" or "bias"
    m  = β2·m + (1-β2)·g

Clipping changes only ``c``'s magnitude within a step, so it reaches Lion's update only through ``m``.
"""

from __future__ import annotations

import torch

from ipuft.components import Init, VariableSpec
from ipuft.optim import Optimizer, StepContext

NO_DECAY = ("norm", "bias")


def requires_weight_decay(name: str) -> bool:
    """Adam's rule (the reference's): no weight decay for layer norms and biases, by the variable's name."""
    return not any(word in name for word in NO_DECAY)


class Lion(Optimizer):
    def __init__(self, beta1: float, beta2: float, weight_decay: float) -> None:
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay

    def state_specs(self, variable: VariableSpec) -> list[VariableSpec]:
        return [VariableSpec("m", variable.shape, torch.float32, Init("zeros"))]

    @torch.no_grad()
    def step(self, name: str, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             ctx: StepContext) -> None:
        m = state["m"]
        update = m.mul(self.beta1).add_(grad, alpha=1.0 - self.beta1).sign_()  # sign(β1·m + (1-β1)·g)
        if self.weight_decay and requires_weight_decay(name):
            weight.mul_(1.0 - ctx.lr * self.weight_decay)  # w - lr·wd·w, on the weight before the step
        weight.add_(update, alpha=-ctx.lr)  # float32: core maps it into a 16-bit weight
        m.mul_(self.beta2).add_(grad, alpha=1.0 - self.beta2)
