"""A unit's gradient over a step's micro-batches: summed (16-bit gradients in float32, rounded once), and its
share of the global norm.

Float32 weights sum their micro-batches' gradients as autograd does, into the leaves' ``.grad``. 16-bit
weights sum theirs in float32 and round once at the end; where no float32 reduction over DP follows, the
last addition is rounded as it is made, into the last gradient itself, and two micro-batches need no float32
sums at all: the same values with fewer passes over the gradients and less memory.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch._subclasses.fake_tensor import is_fake

from ipuft.engine.store import Tensors


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

    def result(self) -> Tensors:
        """The summed gradients: the float32 sums or rounded last parts (16-bit), or the leaves' ``.grad``."""
        return self.sums if self.wide else {n: p.grad for n, p in self.leaves.items()}


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of the squared 2-norms of ``grads``. A 16-bit gradient's norm is taken a chunk at a time
    (torch's norm with ``dtype`` converts the whole tensor first: 0.8 GB for a GPT-J-6B-wide head)."""
    if grads[0].dtype == torch.float32:
        norms = torch.stack(torch._foreach_norm(grads))
    else:
        norms = torch.stack([chunked_norm(g, gradient_chunk(g.device)) for g in grads])
    return norms.square().sum()


def _summing_bytes(size: int, wide: bool, parts: int, data_parallel: int) -> int:
    """The most bytes gradients of ``size`` bytes hold while ``parts`` of them are summed (:class:`GradientSum`).
    With 16-bit weights (``wide``): a 16-bit part beside the float32 sums (twice ``size``), except where no
    float32 reduction over DP follows and two parts at most are summed, which needs only the 16-bit parts.
    Otherwise the accumulated gradients and, from the second part on, the new one beside them."""
    if wide:
        return parts * size if data_parallel == 1 and parts <= 2 else 3 * size
    return 2 * size if parts > 1 else size


def writes_into_stored(wide: bool, takes: int, data_parallel: int, stored: bool) -> bool:
    """Whether a unit's taken weight gradients are written into the gradients it stored the step before
    (``stored``: it has them, in the compute device's memory): where one take is the whole local gradient, in
    16 bits only with no float32 sum over DP to follow."""
    return stored and takes == 1 and (not wide or data_parallel == 1)


def gradient_working_bytes(autograd: int, taken: int, wide: bool, micro_batches: int, takes: int,
                           data_parallel: int, into_stored: bool) -> int:
    """The most bytes a unit's backward holds for its gradients beyond its stored ones: ``autograd`` bytes of
    them made by autograd and summed over the micro-batches, ``taken`` bytes taken over ``takes`` takes
    (:mod:`ipuft.ops`), nothing for those when they are written into the stored gradients (``into_stored``,
    see :func:`writes_into_stored`)."""
    taken_part = 0 if into_stored else _summing_bytes(taken, wide, takes, data_parallel)
    return _summing_bytes(autograd, wide, micro_batches, data_parallel) + taken_part


TAKE_TOKENS = 2048  # a weight gradient taken over this many tokens at least runs at the forward's rate


def take_every(micro_batches: int, tokens: int) -> int:
    """How many micro-batches of ``tokens`` tokens each a unit's taken weight gradients cover at a time (see
    :mod:`ipuft.ops`): enough for ``TAKE_TOKENS`` tokens, at most all of them. Each take's inputs and output
    gradients are held until it is taken, so the bound is also what they cost."""
    return max(1, min(micro_batches, TAKE_TOKENS // max(tokens, 1)))


def gradient_chunk(device: torch.device | str) -> int:
    """The elements the passes over 16-bit gradients (:func:`add_widened_`, :func:`add_rounded_`,
    :func:`chunked_norm`) take at a time on ``device``: a float32 scratch of 1 MiB on the CPU, 16 MiB on a GPU.
    Fixed apart from the optimizer's pieces (:func:`ipuft.engine.update.update_chunk`): the norm's sum depends
    on how the gradient is cut, and the update's results must not."""
    return 1 << 18 if torch.device(device).type == "cpu" else 1 << 22


def _starts(numel: int, chunk: int, t: torch.Tensor) -> range:
    """Where a pass over ``numel`` elements takes its ``chunk``-element pieces: every piece, or over fake tensors
    (:mod:`ipuft.engine.measure`'s measurement) the first alone: the pieces' ops are alike and hold the same
    scratch, so one stands for all (at Llama-3's head, 2,000 pieces a chunk made ``ipuft plan`` take minutes)."""
    return range(0, min(numel, chunk) if is_fake(t) else numel, chunk)


def add_widened_(total: torch.Tensor, part: torch.Tensor, chunk: int) -> None:
    """``total += part`` for a float32 ``total`` and a 16-bit ``part`` (both contiguous), ``chunk`` elements at a
    time through a float32 scratch. ATen's CPU ``add_`` of mixed dtypes first converts the whole of ``part``: a
    float32 copy of the unit's gradient (0.8 GB for a GPT-J-6B-wide embedding) beside the sums, and slower."""
    flat_total, flat_part = total.view(-1), part.view(-1)
    scratch = torch.empty(min(chunk, flat_total.numel()), dtype=total.dtype, device=total.device)
    for start in _starts(flat_total.numel(), chunk, total):
        piece = flat_part[start : start + chunk]
        flat_total[start : start + piece.numel()].add_(scratch[: piece.numel()].copy_(piece))


def add_rounded_(part: torch.Tensor, total: torch.Tensor, chunk: int) -> None:
    """``part = round(total + part)``: the float32 sum of a 16-bit ``part`` and ``total`` (float32, or 16-bit
    like ``part``), rounded to nearest into ``part``, ``chunk`` elements at a time through float32 scratch (the
    same values as adding in float32 and rounding the whole sum: float32 addition is commutative)."""
    flat_part, flat_total = part.view(-1), total.view(-1)
    size = min(chunk, flat_part.numel())
    widened = torch.empty(size, dtype=torch.float32, device=part.device)
    other = torch.empty(size, dtype=torch.float32, device=part.device) if total.dtype != torch.float32 else None
    for start in _starts(flat_part.numel(), chunk, part):
        piece = flat_part[start : start + chunk]
        summed = widened[: piece.numel()].copy_(piece)
        below = flat_total[start : start + piece.numel()]
        summed.add_(below if other is None else other[: piece.numel()].copy_(below))
        piece.copy_(summed)


def narrow_in_place(total: torch.Tensor, dtype: torch.dtype, chunk: int) -> torch.Tensor:
    """``total`` (float32, contiguous) rounded to nearest in the 16-bit ``dtype``, written into the first half of
    its own storage, ``chunk`` elements at a time: a view of that storage, which stays whole (no second tensor of
    the gradient's size beside the float32 sum). Element ``i`` lands in bytes ``[2i, 2i+2)``, below the float32
    elements still to be read (``[4j, 4j+4)`` for ``j > i``), so only the first chunk, which overlaps itself,
    goes through a float32 scratch."""
    flat = total.view(-1)
    out = flat.view(dtype)[: flat.numel()]
    first = flat[:chunk].clone()
    out[: first.numel()].copy_(first)
    for start in range(first.numel(), flat.numel(), chunk):
        out[start : start + chunk].copy_(flat[start : start + chunk])
    return out.view(total.shape)


def chunked_norm(tensor: torch.Tensor, chunk: int) -> torch.Tensor:
    """The float32 2-norm of a 16-bit ``tensor``, ``chunk`` elements at a time through a float32 scratch."""
    flat = tensor.reshape(-1)
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.float32, device=tensor.device)
    squares = [torch.linalg.vector_norm(scratch[: piece.numel()].copy_(piece)).square()
               for piece in flat.split(chunk)]
    return torch.stack(squares).sum().sqrt() if squares else flat.new_zeros((), dtype=torch.float32)
