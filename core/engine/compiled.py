"""The optimizer update in one pass on a device (CUDA): the one-pass kernel's arithmetic (:mod:`ipuft.engine.fused`,
whose C runs only on the CPU) written as elementwise torch ops and compiled by ``torch.compile`` (Inductor), which
fuses them into one kernel a piece (Triton on CUDA, vectorised C++ on the CPU), where the torch-op update launches
some fifteen kernels a piece in float32 and thirty with stochastic rounding, each a pass over memory.

Each element's operations are the ops' (:meth:`ipuft_optim_adam.adamw.AdamW.step_unit`,
:func:`ipuft.precision.stochastic_round_`), in their order and with their float32 scalars, and the compiler is
asked for eager numerics: IEEE-rounded division (``eager_numerics.division_rounding``; Triton's ``/`` is otherwise
approximate) and no contraction into fused multiply-adds (``emulate_precision_casts``); Inductor's square root is
the correctly rounded one. So the results are the ops', bit for bit (tests/test_compiled_update.py on the CPU,
tests/test_cuda.py on CUDA, both run by ``bench/gpu.py``).

The scalars travel as a tensor on the device and the rounding's key and counters as integers the compiler keeps
symbolic, so one compiled kernel (dynamic in the piece's length) serves every step and variable of a recipe; each
pair of weight and gradient dtypes is compiled once, on first use (seconds). Recipes: float32 weights, and bfloat16
or float16 weights rounded stochastically by consecutive counters under 2^31 (every layout's counters but tensor
parallelism's padded shards); a float32 or 16-bit gradient; float32 moments (``adamw8bit``'s codes: its plugin's
kernel, built from :func:`adam`, :func:`store` and :class:`Exact`). Where the compiler fails (no Triton, an
unsupported GPU) the update says so on one line and keeps the torch ops. ``IPUFT_COMPILED_UPDATE=0`` turns it off
(:func:`routes`).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from ipuft.precision import _high, _int32, _shr32

INT31 = 1 << 31
_OPTIONS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}
_state: dict[str, object] = {}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int32 read as unsigned (:func:`ipuft.precision._mix32_`)."""
    x = x ^ _shr32(x, 16)
    x = x * _int32(0x85EBCA6B)
    x = x ^ _shr32(x, 13)
    x = x * _int32(0xC2B2AE35)
    return x ^ _shr32(x, 16)


def _round(value: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """float32 ``value`` rounded stochastically into ``dtype`` by the int32 ``bits``: the integer sum of
    :func:`ipuft.precision._round_by_bits` where it applies, else its float formulation (float16's subnormals) or
    the nearest (NaN, infinities, the largest finite values), branch-free."""
    u = value.view(torch.int32)
    magnitude = u & 0x7FFFFFFF
    if dtype == torch.bfloat16:
        summed = ((u + _shr32(bits, 16)) & -(1 << 16)).view(torch.float32)
        return torch.where(magnitude >= 0x7F7F0000, value, summed).to(dtype)
    summed = ((u + _shr32(bits, 19)) & -(1 << 13)).view(torch.float32)
    scaled = value.abs() * 2.0**24  # float16's subnormals in units of the smallest: exact
    whole = torch.floor(scaled)
    uniform = _shr32(bits, 8).float() * 2.0**-24
    up = torch.where(uniform >= 1.0 - (scaled - whole), whole + 1.0, whole)
    subnormal = torch.copysign(up * 2.0**-24, value)
    normal = (magnitude >= 0x38800000) | (magnitude == 0)
    chosen = torch.where(normal, summed, subnormal)
    return torch.where(magnitude >= 0x477FE000, value, chosen).to(dtype)


def adam(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
         h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One piece's AdamW in float32 (the new weight, ``m`` and ``v``), ``h`` the float32 scalars
    (:class:`ipuft.engine.fused.Hyper`'s order)."""
    g = grad.float() * h[0]
    mm = m * h[1] + g * h[2]
    vv = v * h[3] + (g * g) * h[4]
    d = torch.sqrt(torch.clamp_min(vv, h[7])) / h[5] + h[6]
    return weight.float() * h[8] + (mm / d) * h[9], mm, vv


def store(weight: torch.Tensor, w: torch.Tensor, key: int, first2: int, high: int) -> None:
    """The float32 ``w`` into ``weight``: as it is, or rounded stochastically by the int32 rounding ``key``, the
    first counter plus 2 (``first2``: never 0 or 1, which the compiler would take as constants) and the counters'
    mixed ``high`` half."""
    if weight.dtype == torch.float32:
        weight.copy_(w)
        return
    low = torch.arange(weight.numel(), dtype=torch.int32, device=weight.device) + (first2 - 2)
    weight.copy_(_round(w, weight.dtype, _mix(_mix(low ^ key) ^ high)))


def _adamw(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: torch.Tensor, key: int,
           first2: int, high: int) -> None:
    """One piece's AdamW in place (:func:`adam`, :func:`store`)."""
    w, mm, vv = adam(weight, grad, m, v, h)
    m.copy_(mm)
    v.copy_(vv)
    store(weight, w, key, first2, high)


def scalars(hyper: ctypes.Structure, device: torch.device) -> torch.Tensor:
    """``hyper``'s values as a float32 tensor on ``device``, made once for each set of values (one copy to the
    device for all the pieces of every variable that shares them, where a copy a piece would wait for the device
    each time); the last few kept."""
    values = tuple(getattr(hyper, f) for f, _ in hyper._fields_)
    made = _state.setdefault("scalars", {})
    if (values, device) not in made:
        if len(made) >= 16:
            made.clear()
        made[values, device] = torch.tensor(values, dtype=torch.float32).to(device)
    return made[values, device]


def counters(rounding: tuple[int, int] | None, offset: int = 0) -> tuple[int, int, int]:
    """:func:`store`'s ``(key, first2, high)`` of a piece's rounding ``(key, first counter)`` (None: float32),
    its elements from ``offset`` on."""
    key, first = rounding if rounding is not None else (0, 0)
    return _int32(key), first + offset + 2, _high(key)


class Exact:
    """``fn`` compiled with eager numerics on its first call, under ``no_grad`` (the mode the engine updates in:
    one compilation); where the compiler fails, said once on one line, ``fn`` itself, uncompiled, from then on
    (and :func:`routes` False for every device)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    def __call__(self, *args) -> None:
        if "failed" not in _state:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True, options=_OPTIONS)
                with torch.no_grad():
                    self.compiled(*args)
                return
            except torch.OutOfMemoryError:
                raise  # the device's memory, not the compiler: the ops would need more
            except Exception as e:  # noqa: BLE001 - the compiler fails in many ways (before it writes anything)
                _state["failed"] = True
                line = next((x for x in str(e).strip().splitlines() if x.strip()), type(e).__name__)
                device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "the device")
                print(f"ipuft: the compiled one-pass update is not available on {device} ({line[:200]}); the "
                      f"optimizer updates with torch ops instead (the same results, more slowly)", file=sys.stderr)
        self.fn(*args)


ADAMW = Exact(_adamw)


def routes(device: torch.device) -> bool:
    """Whether pieces on ``device`` take the compiled update: CUDA's (the CPU has the C kernel, and other devices'
    square roots and divisions are not known to round as the ops' do), unless ``IPUFT_COMPILED_UPDATE=0`` or it
    failed to compile before; and the CPU's too under ``IPUFT_COMPILED_UPDATE=cpu`` (tests: the compiled kernel
    in the C one's place)."""
    setting = os.environ.get("IPUFT_COMPILED_UPDATE", "1")
    return (setting != "0" and "failed" not in _state
            and (device.type == "cuda" or (setting == "cpu" and device.type == "cpu")))


def serves(weight: torch.Tensor, grad: torch.Tensor, rounding: tuple[int, int | torch.Tensor] | None) -> bool:
    """Whether :func:`adamw_` can update this piece (on any device): contiguous float32 or 16-bit weight and
    gradient on one device, at least two elements (a length of 0 or 1 would be compiled again, on its own); a
    16-bit weight with consecutive counters under 2^31."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if not (weight.is_contiguous() and grad.is_contiguous() and grad.device == weight.device
            and weight.dtype in dtypes and grad.dtype in dtypes and weight.numel() >= 2):  # 0 and 1: compiled apart
        return False
    if weight.dtype == torch.float32:
        return rounding is None
    return rounding is not None and isinstance(rounding[1], int) and 0 <= rounding[1] <= INT31 - weight.numel()


def adamw_(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: ctypes.Structure,
           rounding: tuple[int, int] | None = None) -> None:
    """:func:`ipuft.engine.fused.adamw_` by the compiled kernel, on ``weight``'s device (a piece :func:`serves`
    takes). Where it cannot compile it says so once and runs the same ops uncompiled (then :func:`routes` is
    False, and the engine keeps its torch-op update from the next group on)."""
    ADAMW(weight.view(-1), grad.view(-1), m.view(-1), v.view(-1), scalars(hyper, weight.device), *counters(rounding))
