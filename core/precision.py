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

import zlib
from collections.abc import Callable
from enum import Enum

import torch
from omegaconf import DictConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Elements rounded at a time: bounds the rounding's temporaries on the device.
ROUNDING_CHUNK = 1 << 20
ROUNDING_BYTES_PER_ELEMENT = 40  # int64 indices and bits, float32 probabilities, 16-bit candidates


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


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2^32`` for int64 ``x`` in [0, 2^32), without int64 overflow (16-bit halves of ``c``)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) that scrambles every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) for each int64 ``index`` ≥ 0, a pure function of ``(key, index)``."""
    high_key = key ^ 0x9E3779B9
    if index.numel() and int(index.max()) < 1 << 32:  # the usual case: the high half mixes to one constant
        high = int(_mix32(torch.tensor(high_key, dtype=torch.int64)))
        return _mix32(_mix32((index & _MASK32) ^ key) ^ high)
    return _mix32(_mix32((index & _MASK32) ^ key) ^ _mix32((index >> 32) ^ high_key))


def round_stochastically(value: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``value`` (float32) rounded into ``dtype``: to the neighbour on either side with the probability
    that makes the expectation ``value`` itself, choosing by ``bits`` (32 random bits per element)."""
    nearest = value.to(dtype)
    near = nearest.float()
    away = torch.where(near > value, float("-inf"), float("inf")).to(dtype)
    other = torch.nextafter(nearest, away)
    gap = other.float() - near
    p_other = torch.where(gap.isfinite() & (gap != 0), (value - near) / gap, 0.0)
    uniform = (bits >> 8).float() * 2.0**-24  # 24 bits: exact in float32
    return torch.where(uniform < p_other, other, nearest)


def stochastic_round_(weight: torch.Tensor, value: torch.Tensor, key: int,
                      indices: Callable[[int, int], torch.Tensor]) -> None:
    """Write float32 ``value`` into 16-bit ``weight`` (same shape), rounded stochastically.

    ``indices(start, count)`` gives the variable-wide index of flat elements ``start … start+count-1`` of
    ``weight`` (int64, on its device): the counter of each element's random bits.
    """
    flat_w, flat_v = weight.view(-1), value.reshape(-1)
    for start in range(0, flat_w.numel(), ROUNDING_CHUNK):
        count = min(ROUNDING_CHUNK, flat_w.numel() - start)
        bits = random_bits(key, indices(start, count))
        flat_w[start : start + count] = round_stochastically(flat_v[start : start + count], weight.dtype, bits)
