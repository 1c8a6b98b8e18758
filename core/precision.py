"""16-bit training: the compute dtype, and how a float32 update lands in a 16-bit weight.

``model.precision`` sets the dtype of the stored weights, of the compute and of the activation buffers.
Everything that sums many small terms stays float32: the loss and its softmax, layer-norm statistics, each
unit's gradient accumulated over its micro-batches, the DP reduction, the global norm and the optimizer.

An optimizer only ever sees float32 (see :mod:`ipuft.optim`): the engine hands it a float32 view of each
weight and maps the updated view back into the 16-bit weight by the run's :class:`Recipe`:

- ``master``: the view *is* a float32 master copy kept in the optimizer state; the weight is cast from it.
- ``stochastic``: the view is a fresh float32 copy; the result is rounded stochastically into the weight,
  up or down with the probabilities that make the rounding unbiased (the reference's recipe).
- ``nearest``: the same, rounded to nearest: an update under half a 16-bit step vanishes.

Stochastic rounding draws its bits from a counter-based generator: element ``i`` of variable ``name`` of
``unit`` at update ``t`` always gets the bits ``hash(seed, unit, name, t, i)``, whatever rank holds it. So
every DP × TP × RTS layout rounds every element as one process does, and a resumed run as an
uninterrupted one.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from enum import Enum

import torch
from omegaconf import DictConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Elements rounded at a time: bounds the rounding's temporaries on the device.
ROUNDING_CHUNK = 1 << 20
ROUNDING_BYTES_PER_ELEMENT = 40  # at most: int64 indices, int32 bits, the rounding's float32 and int32 temporaries


def rounding_workspace(numel: int) -> int:
    """Device bytes that stochastically rounding a variable of ``numel`` elements uses at most at once."""
    return ROUNDING_BYTES_PER_ELEMENT * min(numel, ROUNDING_CHUNK)


class Recipe(str, Enum):
    """How a float32 update reaches a stored weight."""

    exact = "exact"  # float32 weights: the optimizer updates them in place
    master = "master"  # a float32 master copy takes the update; the 16-bit weight is cast from it
    stochastic = "stochastic"  # the update is rounded stochastically into the 16-bit weight
    nearest = "nearest"  # ... or to nearest


def compute_dtype(cfg: DictConfig) -> torch.dtype:
    """``model.precision`` as a torch dtype."""
    return DTYPES[cfg.model.precision.value]


def recipe(cfg: DictConfig) -> Recipe:
    """The run's :class:`Recipe`, from ``model.precision`` and the ``training`` keys."""
    if compute_dtype(cfg) == torch.float32:
        return Recipe.exact
    if cfg.training.master_weights:
        return Recipe.master
    return Recipe.stochastic if cfg.training.stochastic_rounding else Recipe.nearest


def vanishing_updates_warning(cfg: DictConfig) -> str | None:
    """The warning ``plan`` and ``train`` print for 16-bit weights rounded to nearest, else None."""
    if recipe(cfg) is not Recipe.nearest:
        return None
    return (f"model.precision={cfg.model.precision.value} with neither training.stochastic_rounding nor "
            f"training.master_weights rounds each update to nearest: updates under half a 16-bit step vanish "
            f"(at lr {cfg.training.optimizer.learning_rate.maximum:g}, most of them); set one of the two")


def rounding_key(seed: int, unit: str, name: str, update: int) -> int:
    """The 32-bit key of one variable's stochastic rounding at one update."""
    return zlib.crc32(f"{seed}/{unit}/{name}/{update}".encode())


def _int32(c: int) -> int:
    """The int32 whose two's-complement bits are those of ``c`` in [0, 2^32)."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr32(x: torch.Tensor, s: int) -> torch.Tensor:
    """The logical right shift of int32 ``x`` read as unsigned (``>>`` on int32 shifts the sign in)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _xorshift_(x: torch.Tensor, s: int, scratch: torch.Tensor) -> torch.Tensor:
    """``x ^= x >>> s`` in place (a logical shift of ``x`` read as unsigned), through ``scratch``."""
    torch.bitwise_right_shift(x, s, out=scratch)
    return x.bitwise_xor_(scratch.bitwise_and_((1 << (32 - s)) - 1))


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place on an int32 tensor read as unsigned: a bijection of [0, 2^32)
    that scrambles every input bit. Multiplication of int32 tensors keeps the low 32 bits of the product, as
    unsigned arithmetic would (a wrapping multiply on every backend), so no op needs int64: much faster than
    int64 arithmetic masked back to 32 bits, on the CPU. In place, through one scratch
    tensor, it allocates nothing: eleven passes over ``x``."""
    _xorshift_(x, 16, scratch).mul_(_int32(0x85EBCA6B))
    _xorshift_(x, 13, scratch).mul_(_int32(0xC2B2AE35))
    return _xorshift_(x, 16, scratch)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32_` on a copy."""
    x = x.clone()
    return _mix32_(x, torch.empty_like(x))


def _mix32_int(x: int) -> int:
    """:func:`_mix32` of one unsigned 32-bit Python integer."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _hash_(low: torch.Tensor, key: int, high: torch.Tensor | int) -> torch.Tensor:
    """``mix(mix(low ^ key) ^ high)``, in place on the int32 ``low`` (``high``: the mixed high halves)."""
    scratch = torch.empty_like(low)
    _mix32_(low.bitwise_xor_(_int32(key)), scratch)
    return _mix32_(low.bitwise_xor_(high), scratch)


def _high(key: int) -> int:
    """The mixed high half of every index under 2^32, as an int32."""
    return _int32(_mix32_int(key ^ 0x9E3779B9))


def _bits32(key: int, index: torch.Tensor) -> torch.Tensor:
    """:func:`random_bits` as int32 (the same 32 bits, read as unsigned)."""
    low = index.to(torch.int32)  # the low 32 bits (int64 → int32 keeps them); a new tensor
    if index.numel() and int(index.max()) >= 1 << 32:
        high_index = (index >> 32).to(torch.int32).bitwise_xor_(_int32(key ^ 0x9E3779B9))
        high = _mix32_(high_index, torch.empty_like(high_index))
    else:  # the usual case: the high half mixes to one constant
        high = _high(key)
    return _hash_(low, key, high)


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device, int32 0, 1, 2, ... (arange is slow on the CPU)


def _range_bits32(key: int, first: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`_bits32` of the consecutive indices ``first … first+count-1``, made as int32 directly."""
    if first + count > 1 << 31:
        return _bits32(key, torch.arange(first, first + count, dtype=torch.int64, device=device))
    device = torch.device(device)
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        counters = _COUNTERS[device] = torch.arange(max(count, ROUNDING_CHUNK), dtype=torch.int32, device=device)
    return _hash_(torch.add(counters[:count], first), key, _high(key))


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) for each int64 ``index`` ≥ 0, a pure function of ``(key, index)``:
    ``mix(mix(low(index) ^ key) ^ mix(high(index) ^ key ^ 0x9E3779B9))`` with ``mix`` :func:`_mix32` and
    ``low``/``high`` the halves of the index."""
    return _bits32(key, index).to(torch.int64) & 0xFFFFFFFF


def round_stochastically(value: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``value`` (float32) rounded into ``dtype``: to the neighbour on either side with the probability
    that makes the expectation ``value`` itself, choosing by ``bits`` (32 random bits per element, int64 or
    int32). The rounding is :func:`_round_by_neighbours`'s, computed as :func:`_round_by_bits` for bfloat16
    and float16 (a float32 ``dtype`` keeps ``value``)."""
    bits = bits.to(torch.int32)  # the low 32 bits
    if dtype in _DROPPED_BITS:
        return _round_by_bits(value, dtype, bits)
    return _round_by_neighbours(value, dtype, bits)


def _round_by_neighbours(value: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``value``'s neighbour away from zero in ``dtype`` is taken with the probability ``p`` that makes the
    expectation ``value`` itself, where the top 24 of the int32 ``bits``, as a fraction ``u`` of 2^24, reach
    ``1 - p`` (both are exact in float32); otherwise its neighbour toward zero. NaN, infinities and values whose
    neighbour away would be infinite round to nearest."""
    nearest = value.to(dtype)
    near = nearest.float()
    beyond = near.abs() > value.abs()  # the nearest is the neighbour away from zero
    zero = torch.zeros((), dtype=dtype, device=value.device)
    toward = torch.where(beyond, torch.nextafter(nearest, zero), nearest)
    away = torch.nextafter(toward, torch.where(value < 0, float("-inf"), float("inf")).to(dtype))
    low, gap = toward.float(), away.float() - toward.float()
    p_away = torch.where(gap.isfinite() & (gap != 0), (value - low) / gap, 0.0)
    uniform = _shr32(bits, 8).float() * 2.0**-24  # 24 bits: exact in float32
    chosen = torch.where(uniform >= 1.0 - p_away, away, toward)
    return torch.where(gap.isfinite() & value.isfinite(), chosen, nearest)


# Per 16-bit dtype: the float32 mantissa bits it drops, and the float32 magnitudes (bit patterns) between
# which its neighbours are the float32 bits with those cleared and that plus one step: from its smallest
# normal (0 for bfloat16, which shares float32's exponents, subnormals included) to under its largest
# finite value (whose step away is infinite).
_DROPPED_BITS = {torch.bfloat16: (16, 0, 0x7F7F0000), torch.float16: (13, 0x38800000, 0x477FE000)}
_BFLOAT16_LARGEST = struct.unpack("<f", struct.pack("<I", 0x7F7F0000))[0]  # as a float: bfloat16's largest finite


def _round_by_bits(value: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_round_by_neighbours` on the float32 bit patterns, bit for bit and several times as fast; into
    ``out`` (a tensor of ``dtype`` shaped like ``value``) when given.

    Where a 16-bit value is a float32 with its low ``d`` mantissa bits cleared (bfloat16: d = 16; float16
    in its normal range: d = 13), the neighbours of ``value`` are its bits with those cleared (toward zero)
    and that plus one step ``2^d`` (away from zero, for either sign), and ``low``, the bits cleared, is how far
    it lies from the first in ``2^-d`` of a step: ``p = low / 2^d``. Away is taken where ``u ≥ 1 - p``, that is
    where the top ``d`` bits of the draw, ``t``, reach ``2^d - low`` (``u·2^24`` and ``(2^d - low)·2^(24-d)``
    are integers, the second a multiple of ``2^(24-d)``): where ``low + t`` carries into the kept bits. So the
    rounding is the integer sum ``bits(value) + t`` with the low ``d`` bits cleared, exactly, a carry out of
    the mantissa stepping into the next binade as it should. Elements outside that range (NaN, infinities,
    the largest finite values, float16's subnormals) take the float formulation itself.

    Six passes for bfloat16 (the draw's top bits, the sum, the mask, the cast, one min/max to find the elements
    outside), a few more for float16, in int32 ops into a chunk-sized buffer.
    """
    dropped, smallest, largest = _DROPPED_BITS[dtype]
    v = value.view(torch.int32)
    work = torch.bitwise_right_shift(bits.to(torch.int32), 32 - dropped).bitwise_and_((1 << dropped) - 1)
    rounded = work.add_(v).bitwise_and_(-(1 << dropped)).view(torch.float32)  # the dropped bits are now zero
    out = rounded.to(dtype) if out is None else out.copy_(rounded)  # exact
    if not value.numel():
        return out
    if smallest:  # float16: the magnitudes' bit patterns, for both ends of the range
        magnitude = work.copy_(v).bitwise_and_(0x7FFFFFFF)
        outside = int(magnitude.max()) >= largest
        # zero (magnitude - 1 wraps high) is its own neighbour; float16's subnormals are not float32s with bits cleared
        outside = outside or int(magnitude.sub_(1).bitwise_and_(0x7FFFFFFF).min()) < smallest - 1
    else:  # bfloat16: only the largest magnitudes, NaN and infinities (NaN makes both NaN, and is caught)
        low_end, high_end = torch.aminmax(value)
        outside = not (float(low_end) > -_BFLOAT16_LARGEST and float(high_end) < _BFLOAT16_LARGEST)
    if outside:
        magnitude = v & 0x7FFFFFFF
        where = magnitude >= largest
        if smallest:
            where |= (magnitude < smallest) & (magnitude != 0)
        index = where.view(-1).nonzero().view(-1)
        flat = out.view(-1)
        flat[index] = _round_by_neighbours(value.reshape(-1)[index], dtype, bits.reshape(-1)[index].to(torch.int32))
    return out


def stochastic_round_(weight: torch.Tensor, value: torch.Tensor, key: int,
                      indices: Callable[[int, int], torch.Tensor | int]) -> None:
    """Write float32 ``value`` into 16-bit ``weight`` (same shape, both contiguous), rounded stochastically.

    ``indices(start, count)`` gives the variable-wide index of flat elements ``start … start+count-1`` of
    ``weight``: the counter of each element's random bits. It is an int64 tensor on the weight's device, or,
    where those elements are consecutive in the variable, the index of the first (an int), which saves
    making the indices.
    """
    flat_w, flat_v = weight.view(-1), value.reshape(-1)
    for start in range(0, flat_w.numel(), ROUNDING_CHUNK):
        count = min(ROUNDING_CHUNK, flat_w.numel() - start)
        first = indices(start, count)
        bits = (_range_bits32(key, first, count, weight.device) if isinstance(first, int)
                else _bits32(key, first))
        _round_by_bits(flat_v[start : start + count], weight.dtype, bits, out=flat_w[start : start + count])
