"""``adamw8bit``'s update of a piece in one compiled kernel on a device (CUDA; :mod:`ipuft.engine.compiled`): each
block's codes decoded, ``adamw``'s arithmetic, the weight stored (rounded stochastically when 16-bit), the block's
absmax and codes found again, in the torch ops' order (:meth:`.adamw8bit.AdamW8bit.step_unit`:
:func:`.quantize.dequantize`, ``adamw``, :func:`.quantize.quantize_`), so bit for bit theirs."""

from __future__ import annotations

import ctypes

import torch

from ipuft.engine import compiled
from ipuft_optim_adamw8bit.quantize import encode


def _decode(codes: torch.Tensor, absmax: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return values[codes.int()] * absmax.unsqueeze(1)


def _encode(x: torch.Tensor, base: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    return encode(x.reshape(-1), base, bound).view(x.shape)


def _adamw8bit(weight: torch.Tensor, grad: torch.Tensor, mc: torch.Tensor, vc: torch.Tensor, m_absmax: torch.Tensor,
               v_absmax: torch.Tensor, m_book: tuple[torch.Tensor, ...], v_book: tuple[torch.Tensor, ...],
               h: torch.Tensor, key: int, first2: int, high: int) -> None:
    """One piece of whole blocks (``[blocks, block]``; ``weight`` and ``grad`` flat), in place: codes ``mc``,
    ``vc`` and their absmax; each map's ``(values, base, bound)``."""
    shape = mc.shape
    m = _decode(mc, m_absmax, m_book[0])
    v = _decode(vc, v_absmax, v_book[0])
    w, mm, vv = compiled.adam(weight, grad, m.view(-1), v.view(-1), h)
    compiled.store(weight, w, key, first2, high)
    mm, vv = mm.view(shape), vv.view(shape)
    m_max, v_max = torch.amax(mm.abs(), dim=1), torch.amax(vv, dim=1)  # v is never negative
    m_absmax.copy_(m_max)
    v_absmax.copy_(v_max)
    mc.copy_(_encode(mm / torch.where(m_max > 0, m_max, 1.0).unsqueeze(1), m_book[1], m_book[2]))
    vc.copy_(_encode(vv / torch.where(v_max > 0, v_max, 1.0).unsqueeze(1), v_book[1], v_book[2]))


ADAMW8BIT = compiled.Exact(_adamw8bit)


def adamw8bit_(weight: torch.Tensor, grad: torch.Tensor, codes: dict[str, torch.Tensor],
               absmax: dict[str, torch.Tensor], tables: dict[str, tuple[torch.Tensor, ...]], block: int,
               hyper: ctypes.Structure, rounding: tuple[int, int] | None = None) -> None:
    """:func:`ipuft.engine.fused.adamw8bit_` by the compiled kernel (a piece :func:`ipuft.engine.compiled.serves`
    takes, starting on a block boundary): its whole blocks in one call, a short last block in another."""
    n = weight.numel()
    h = compiled.scalars(hyper, weight.device)
    books = [tables[k][:3] for k in ("m", "v")]
    flat = [t.view(-1) for t in (weight, grad, codes["m"], codes["v"])]
    whole = n // block * block
    for a, b in ((0, whole), (whole, n)):
        if b - a:
            length = min(block, b - a)
            w, g, mc, vc = (t[a:b] for t in flat)
            ADAMW8BIT(w, g, mc.view(-1, length), vc.view(-1, length), absmax["m"][a // block : -(-b // block)],
                      absmax["v"][a // block : -(-b // block)], *books, h, *compiled.counters(rounding, a))
