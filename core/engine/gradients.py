"""A unit's gradient over a step's micro-batches: summed (16-bit gradients in float32, rounded once), and its
share of the global norm.

Float32 weights sum their micro-batches' gradients as autograd does, into the leaves' ``.grad``. 16-bit
weights sum theirs in float32 and round once at the end; where no float32 reduction over DP follows, the
last addition is rounded as it is made, into the last gradient itself, and two micro-batches need no float32
sums at all: the same values with fewer passes over the gradients and less memory.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch

from ipuft.engine.store import Tensors, storage_bytes
from ipuft.widen import add_rounded_, add_widened_, chunked_norm, gradient_chunk, narrow_in_place


class GradientSum:
    """The gradients of a unit's ``leaves`` summed over the micro-batches of one step."""

    def __init__(self, leaves: Tensors, wide: bool, device: torch.device, data_parallel: int,
                 exact: Collection[str] = ()) -> None:
        """``wide``: the weights are 16-bit, so the sums are float32 (:meth:`add`); else autograd sums into
        the leaves' ``.grad``. The ``exact`` leaves' sums stay float32 (never rounded here)."""
        self.leaves = leaves
        self.wide = wide
        self.chunk = gradient_chunk(device)
        self.rounded_here = data_parallel == 1  # no float32 reduction over DP follows
        self.exact = set(exact)
        self.sums: Tensors = {}

    def add(self, name: str, grad: torch.Tensor, index: int, count: int) -> None:
        """Add ``grad``, the ``index``-th of the ``count`` parts ``name``'s gradient is summed from (a
        micro-batch's, or a take's)."""
        if not self.wide:
            leaf = self.leaves[name]
            leaf.grad = grad if leaf.grad is None else leaf.grad.add_(grad)
            return
        summed = self.sums.get(name)
        rounded_here = self.rounded_here and name not in self.exact
        dtype = self.leaves[name].dtype
        if summed is None and rounded_here and index == count - 1 and grad.dtype != dtype:
            self.sums[name] = narrow_in_place(grad, dtype, self.chunk)  # the whole sum already (an accumulator's)
        elif summed is None:  # the first part: kept as it is where one addition at most follows
            self.sums[name] = grad if rounded_here and count <= 2 else grad.float()
        elif index == count - 1 and rounded_here:
            add_rounded_(grad, summed, self.chunk)
            self.sums[name] = grad
        else:
            add_widened_(summed, grad, self.chunk)

    def add_autograd(self, mb: int, micro_batches: int) -> None:
        """After micro-batch ``mb``'s backward: with 16-bit weights, move what autograd made in each leaf's
        ``.grad`` into the sums (float32 weights keep accumulating there)."""
        if not self.wide:
            return
        for name, leaf in self.leaves.items():
            if leaf.grad is not None:
                self.add(name, leaf.grad, mb, micro_batches)
                leaf.grad = None

    def tensors(self) -> list[torch.Tensor]:
        """The float32 sums (and rounded last parts) so far: nothing for float32 weights, summed in ``.grad``."""
        return list(self.sums.values())

    def bytes(self, excluded: Iterable[torch.Tensor] = ()) -> int:
        """The bytes the sum holds now (its float32 sums and the leaves' ``.grad``, autograd's part), each
        storage once, but for the storages of ``excluded`` (memory counted elsewhere: the stored gradients)."""
        return storage_bytes([*self.tensors(), *(p.grad for p in self.leaves.values() if p.grad is not None)],
                             excluded)

    def result(self) -> Tensors:
        """The summed gradients: the float32 sums or rounded last parts (16-bit), or the leaves' ``.grad``; none
        for a leaf whose gradient went elsewhere (a head's by vocabulary slices, :mod:`ipuft.engine.sliced`)."""
        return self.sums if self.wide else {n: p.grad for n, p in self.leaves.items() if p.grad is not None}


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of the squared 2-norms of ``grads``. A 16-bit gradient's norm is taken a chunk at a time
    (torch's norm with ``dtype`` converts the whole tensor first: 0.8 GB for a GPT-J-6B-wide head)."""
    if grads[0].dtype == torch.float32:
        norms = torch.stack(torch._foreach_norm(grads))
    else:
        norms = torch.stack([chunked_norm(g, gradient_chunk(g.device)) for g in grads])
    return norms.square().sum()


