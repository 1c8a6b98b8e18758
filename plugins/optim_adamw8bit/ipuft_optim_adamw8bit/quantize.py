"""Block-wise dynamic quantization (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").

A tensor is cut into blocks of ``block`` consecutive elements of its flat form (the last one may be shorter);
each block is divided by its largest magnitude (its *absmax*, kept in float32) into [-1, 1], and each element
stored as the uint8 index of the nearest of 256 values, the dynamic data type's:

- *signed* (Adam's first moment): a sign bit; then ``E`` zeros (0 … 6), read as the exponent ``10^-E``; an
  indicator bit 1; and the remaining ``6 - E`` bits a linear fraction, the midpoint of one of ``2^(6-E)``
  equal bins of [0.1, 1]. Small magnitudes get few fraction bits, large ones many, which is what the
  moments' heavy-tailed blocks need.
- *unsigned* (the second moment, never negative): the sign bit is one more fraction bit, ``7 - E`` of them.

Of the bit patterns with no indicator bit, one is 0; the other (a second zero when signed, the lone value
``10^-7·0.55`` when not) is 1.0 instead, as bitsandbytes' maps do, so that each block's largest magnitude
comes back exact. The values are sorted, so that a code's order is its value's.
"""

from __future__ import annotations

import math

import torch


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic data type, sorted ascending, float32."""
    fraction_bits = 6 if signed else 7  # when the exponent has no zeros
    values = [0.0, 1.0]
    for zeros in range(7):
        bits = fraction_bits - zeros
        for k in range(2**bits):
            magnitude = 10.0**-zeros * (0.1 + 0.9 * (k + 0.5) / 2**bits)
            values += [magnitude, -magnitude] if signed else [magnitude]
    return torch.tensor(sorted(values), dtype=torch.float32)


def lower_midpoints(values: torch.Tensor) -> torch.Tensor:
    """For sorted float32 ``values``, the largest float32 at or below each exact midpoint of two neighbours.

    A float32 ``x`` is above the exact midpoint ``(a + b) / 2`` exactly when it is above that float32, so
    counting the bounds below ``x`` (``searchsorted``) picks the nearest value, and the lower one on a tie,
    with no float64 pass over the data: the midpoint rule, exactly."""
    exact = (values[1:].double() + values[:-1].double()) / 2  # exact: a float32 sum fits a float64
    bounds = exact.float()
    above = bounds.double() > exact
    return torch.where(above, torch.nextafter(bounds, torch.tensor(-math.inf)), bounds)


BUCKET_SHIFT = 15  # a float32's bucket: its top 17 bits (sign, exponent, 8 bits of mantissa)


def bucket_tables(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables over the 2^17 *buckets* of float32, the floats that share their top 17 bits (an interval of reals
    2^-8 of its exponent's range wide): for each, the number of ``bounds`` below the bucket (int32) and the bound
    inside it (float32; +inf if none), so that the count of bounds below any ``x`` is ``base + (x > bound)`` of
    ``x``'s bucket.

    One is enough where neighbouring bounds are more than 2^-8 apart relative to their size, which holds for
    both dynamic maps (at least 0.5% apart; checked here)."""
    patterns = torch.arange(1 << (32 - BUCKET_SHIFT), dtype=torch.int64) << BUCKET_SHIFT
    ends = torch.stack([patterns, patterns | ((1 << BUCKET_SHIFT) - 1)])
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).to(torch.int32).view(torch.float32).double()
    low, high = ends.amin(dim=0), ends.amax(dim=0)  # a negative bucket's floats fall as its bits rise
    exact = bounds.double()
    base = torch.searchsorted(exact, low)  # bounds < low
    inside = torch.searchsorted(exact, high, right=True) - base  # low <= bound <= high
    inside = torch.where(low.isfinite() & high.isfinite(), inside, 0)  # NaN patterns: never looked up
    if int(inside.max()) > 1:
        raise ValueError("a float32 bucket holds more than one bound of the map")
    padded = torch.cat([bounds, torch.tensor([math.inf])])
    bound = torch.where(inside > 0, padded[base.clamp(max=bounds.numel())], math.inf)
    return base.to(torch.uint8), bound.float()  # at most 255 bounds lie below any float


def code_words(base: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The one-pass kernel's table (``encode`` in ``ipuft/engine/update_kernel.c``): an int32 word for each of the
    2^17 buckets, read by a float's bits shifted right by 15. A word is ``base << 15 | (0x7FFF - low)``, ``low``
    being the low 15 bits of the bucket's ``bound`` (mirrored in negative buckets, so that a larger value has larger
    low bits; 0x7FFF where there is none, and in the NaNs' buckets), so that adding a float's own low 15 bits
    (mirrored likewise) carries into bit 15 exactly when it lies above the bound: the code is that sum shifted
    right by 15, for every float32, as :func:`encode` gives it. 512 KiB, of which a block's values read the
    kilobyte of each exponent they have."""
    negative = torch.arange(1 << (32 - BUCKET_SHIFT)) >= 1 << (31 - BUCKET_SHIFT)
    own = (bound.view(torch.int32) & 0x7FFF) ^ torch.where(negative, 0x7FFF, 0)
    low = torch.where(bound.isfinite(), own, 0x7FFF)
    return (base.to(torch.int32) << 15 | (0x7FFF - low)).to(torch.int32)


def encode(x: torch.Tensor, base: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The uint8 codes of flat float32 ``x`` by a map's bucket tables (:func:`bucket_tables`): ``base + (x >
    bound)`` of each float's bucket (:meth:`Codebook.encode`; the compiled kernel's too)."""
    bucket = x.view(torch.int32).bitwise_right_shift(BUCKET_SHIFT).bitwise_and_((1 << (32 - BUCKET_SHIFT)) - 1)
    code = base.index_select(0, bucket)
    code += x > bound.index_select(0, bucket)  # base + 1 <= 255: a bound in the bucket is above ``base`` others
    return code


class Codebook:
    """One dynamic data type: its values, and the tables that find each float32's nearest value, per device."""

    def __init__(self, signed: bool):
        self.signed = signed
        values = dynamic_map(signed)
        self.bounds = lower_midpoints(values)
        base, bound = bucket_tables(self.bounds)
        self._cpu = (values, base, bound, code_words(base, bound))
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in self._cpu)
        return self._on[device]

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        """The uint8 code of each element of ``normalized`` (float32 in [-1, 1]): the nearest value's index,
        the lower on a tie, i.e. the number of bounds below it (what ``searchsorted`` over the bounds counts,
        several times faster: two gathers by the float's top 17 bits and one comparison)."""
        _, base, bound, _ = self.tables(normalized.device)
        return encode(normalized.contiguous().view(-1), base, bound).view(normalized.shape)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The float32 value of each uint8 code."""
        values = self.tables(codes.device)[0]
        return values.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _blocks(flat: torch.Tensor, block: int) -> list[tuple[torch.Tensor, slice]]:
    """``flat`` as its whole blocks ``[n // block, block]`` and its short last block ``[1, n % block]``, each with
    the slice of the per-block values it goes with."""
    whole = flat.numel() // block
    parts = [(flat[: whole * block].view(whole, block), slice(0, whole))] if whole else []
    if flat.numel() % block:
        parts.append((flat[whole * block :].view(1, -1), slice(whole, whole + 1)))
    return parts


def quantize_(codes: torch.Tensor, absmax: torch.Tensor, x: torch.Tensor, book: Codebook, block: int) -> None:
    """Write the block-wise quantization of float32 ``x`` (flat) into ``codes`` (uint8, like ``x``) and ``absmax``
    (float32, one per block). A block of zeros has absmax 0 and codes of 0's value."""
    normalized = torch.empty_like(x)
    for (part, blocks), (out, _) in zip(_blocks(x, block), _blocks(normalized, block), strict=True):
        if book.signed:  # (abs then amax: 9x faster here than vector_norm's inf-norm)
            torch.amax(part.abs(), dim=1, out=absmax[blocks])
        else:  # v is never negative
            torch.amax(part, dim=1, out=absmax[blocks])
        scale = absmax[blocks].unsqueeze(1)
        torch.div(part, torch.where(scale > 0, scale, 1.0), out=out)
    codes.view(-1).copy_(book.encode(normalized))


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, book: Codebook, block: int) -> torch.Tensor:
    """The float32 values (flat) that ``codes`` and their blocks' ``absmax`` stand for."""
    x = book.decode(codes.view(-1))
    for part, blocks in _blocks(x, block):
        part.mul_(absmax[blocks].unsqueeze(1))
    return x
