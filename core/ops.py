"""Building blocks for component modules (this module imports torch; plugins import it from their modules, not
from their hooks).

- :func:`output_projection`: ``x @ weight.T`` that, while the engine recomputes a layer only for its gradient
  (:func:`ipuft.components.recomputing`), skips the forward matmul whose value nobody reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ipuft.components import recomputing


class _GradientOnlyLinear(torch.autograd.Function):
    """``x @ weight.T`` whose forward value is never read: it returns zeros, and its backward is exact.

    In a recompute only the gradient graph of the layer's output is used, so the output projections'
    forward matmuls (5 of GPT-J's 12·H² multiply-adds per token, a third of a Llama layer's) can be skipped.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def output_projection(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias), or its gradient-only stand-in while the engine recomputes."""
    if recomputing() and torch.is_grad_enabled():
        return _GradientOnlyLinear.apply(x, weight)
    return F.linear(x, weight)
