"""Float32 arithmetic on 16-bit tensors a chunk at a time, through a small float32 scratch: sums into float32
(:func:`add_widened_`), sums rounded back (:func:`add_rounded_`), a float32 sum narrowed in its own storage
(:func:`narrow_in_place`) and a norm (:func:`chunked_norm`). ATen's mixed-dtype ops convert a whole operand
first, which at a wide model's embedding is a float32 copy of the gradient beside its sums. Used by the
engine's gradient sums and by the chunked head's loss (:mod:`ipuft.head_loss`)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def gradient_chunk(device: torch.device | str) -> int:
    """The elements the passes over 16-bit gradients (:func:`add_widened_`, :func:`add_rounded_`,
    :func:`chunked_norm`) take at a time on ``device``: a float32 scratch of 1 MiB on the CPU, 16 MiB on a GPU.
    Fixed apart from the optimizer's pieces (:func:`ipuft.engine.cuts.update_chunk`): the norm's sum depends
    on how the gradient is cut, and the update's results must not."""
    return 1 << 18 if torch.device(device).type == "cpu" else 1 << 22


def _starts(numel: int, chunk: int, t: torch.Tensor) -> range:
    """Where a pass over ``numel`` elements takes its ``chunk``-element pieces: every piece, or over fake tensors
    (:mod:`ipuft.plan.measure`'s measurement) the first alone: the pieces' ops are alike and hold the same
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
