"""The optimizer update in one pass over memory, on the CPU: a small C kernel (``update_kernel.c``), built with
the system's C compiler on first use and cached, called through :mod:`ctypes`.

The update of a piece is otherwise a chain of torch ops, each a pass over its tensors: the loss-scale and
clipping factor, the two moments, the denominator, decay, the weight, and for 16-bit weights a float32 copy
and stochastic rounding's dozen int32 passes. The kernel reads each element's weight, gradient and moments
once, computes all of that in registers (vectorised by the compiler, split over torch's own OpenMP threads where
the compiler has OpenMP, else threads of its own) and writes the weight and the moments once: the speed of
memory. It does, element for element, exactly the
float32 operations of ``adamw``'s torch-op update (:meth:`ipuft_optim_adam.adamw.AdamW.step`) and the rounding
of :func:`ipuft.precision.stochastic_round_` with the same random bits, each an IEEE operation rounded
once (no contraction into fused multiply-adds, no fast-math), so its results equal the ops' bit for bit
(tests/test_fused_update.py) and a machine without a compiler gets the same run, more slowly.

Recipes: float32 weights; bfloat16 and float16 weights with stochastic rounding (the loss-scaled float16
recipe included: the loss scale is part of the gradient's factor); float32 moments, or ``adamw8bit``'s
block-wise 8-bit codes. On CUDA :mod:`ipuft.engine.compiled` does the same (the codes: the plugin's own); anything
else (another device, a master copy, rounding to nearest) keeps the ops.

``IPUFT_UPDATE_KERNEL=0`` turns the kernel off; ``CC`` names the compiler (default ``cc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ipuft.engine import compiled

SOURCE = Path(__file__).with_name("update_kernel.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the weight's dtype; 16-bit: rounded stochastically
MAX_BLOCK = 4096  # the kernel's largest 8-bit block
WORDS = 1 << 17  # an 8-bit map's table: a word for each float32 bucket (bits >> 15)
MIN_THREAD_ELEMENTS = 1 << 15  # fewer elements a thread than this: fewer threads (starting one costs ~20 µs)

_HYPER = ("factor", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "sqrt_bias2", "eps", "floor", "decay",
          "step")


class Hyper(ctypes.Structure):
    """One variable's scalars of one update, as float32 (what torch makes of a Python float scalar on a float32
    tensor): the gradient's factor, β1, 1-β1, β2, 1-β2, √bias2, eps, the floor under ``v``, the decay factor
    ``1 - lr·wd`` and the step ``-lr / bias1``."""

    _fields_ = [(name, ctypes.c_float) for name in _HYPER]


_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("IPUFT_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ipuft", "kernels")
    return Path(root)


def _machine() -> str:
    """What a ``-march=native`` build depends on: the host and its CPU's model."""
    model = ""
    with contextlib.suppress(OSError):
        model = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.node()}/{platform.machine()}/{model}"


def _cached(source: bytes, compiler: str, flags: list[str]) -> Path:
    """Where the build of ``source`` by ``compiler`` with ``flags`` on this machine is cached."""
    digest = hashlib.sha256(source + repr((compiler, flags, _machine())).encode()).hexdigest()[:16]
    return _cache_dir() / f"update-{digest}.so"


def _build() -> ctypes.CDLL:
    """The kernel's shared library: the cached build, or a fresh one (written atomically, so that ranks
    starting together never load a half-written file)."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} is not on PATH)")
    source = SOURCE.read_bytes()
    # OpenMP where the compiler has it (torch's threads: see run() in the source), else without; a cached build of
    # either is taken before compiling, so that a compiler without OpenMP is not asked again at every start
    builds = [(extra, _cached(source, compiler, FLAGS + extra)) for extra in (["-fopenmp"], [])]
    target = next((path for _, path in builds if path.exists()), None)
    failed = ""
    if target is None:
        for extra, path in builds:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                done = subprocess.run([compiler, *FLAGS, *extra, str(SOURCE), "-o", str(built)], capture_output=True,
                                      text=True, check=False)
                if not done.returncode:
                    os.replace(built, path)
                    target = path
                    break
                failed = (done.stderr.strip().splitlines() or ["?"])[-1]
    if target is None:
        raise OSError(f"{compiler} failed: {failed}")
    lib = ctypes.CDLL(str(target))
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.ipuft_adamw.argtypes = [i64, p, i32, p, i32, p, p, ctypes.POINTER(Hyper), u32, i64, p, i32, i64]
    lib.ipuft_adamw8bit.argtypes = [i64, p, i32, p, i32, p, p, p, p, p, p, p, p, i64, ctypes.POINTER(Hyper), u32,
                                    i64, p, i32, i64]
    lib.ipuft_encode8.argtypes = [i64, p, p, p]
    lib.ipuft_openmp.argtypes = []
    lib.ipuft_set_bf16_nan.argtypes = [u32]
    for name in ("ipuft_adamw", "ipuft_adamw8bit", "ipuft_encode8", "ipuft_openmp", "ipuft_set_bf16_nan"):
        getattr(lib, name).restype = i32
    # a NaN weight gets the bits the ops' conversion gives it (torch's own depend on its CPU capability)
    lib.ipuft_set_bf16_nan(torch.tensor([float("nan")]).bfloat16().view(torch.int16).item() & 0xFFFF)
    return lib


def library() -> ctypes.CDLL | None:
    """The kernel, or ``None`` where it is turned off or cannot be built (said once, on one line)."""
    if "lib" not in _state:
        lib = None
        if os.environ.get("IPUFT_UPDATE_KERNEL", "1") != "0":
            try:
                lib = _build()
            except OSError as e:
                print(f"ipuft: the one-pass update kernel is not available ({e}); the optimizer updates with "
                      f"torch ops instead (the same results, more slowly)", file=sys.stderr)
        _state["lib"] = lib
    return _state["lib"]  # type: ignore[return-value]


def serves(weight: torch.Tensor, grad: torch.Tensor, rounding: object) -> bool:
    """Whether the one-pass update can do this piece: on the CPU the kernel (contiguous, a float32 weight
    (``rounding`` None) or a 16-bit one rounded stochastically (``rounding`` given), a float32 or 16-bit
    gradient); on CUDA the compiled update (:mod:`ipuft.engine.compiled`), for the same pieces but those whose
    counters are not consecutive."""
    if compiled.routes(weight.device):
        return compiled.serves(weight, grad, rounding)
    return (weight.device.type == "cpu" and grad.device.type == "cpu" and weight.is_contiguous()
            and grad.is_contiguous() and grad.dtype in MODES and weight.dtype in MODES
            and (weight.dtype == torch.float32) == (rounding is None) and library() is not None)


def by_compiled(device: torch.device) -> bool:
    """Whether a piece :func:`serves` takes on ``device`` is updated by the compiled kernel, not the C one: any
    device but the CPU (after a failed compile too, whose eager functions run there), and the CPU where
    :func:`ipuft.engine.compiled.routes` sends it."""
    return device.type != "cpu" or compiled.routes(device)


def _rounding(rounding: tuple[int, int | torch.Tensor] | None, n: int) -> tuple[int, int, int | None]:
    """``(key, first, indices pointer)`` of a piece's stochastic rounding: its key and either the variable-wide
    index of its first element (consecutive) or an int64 tensor of every element's."""
    if rounding is None:
        return 0, 0, None
    key, counters = rounding
    if isinstance(counters, int):
        return key, counters, None
    assert counters.dtype == torch.int64 and counters.numel() == n and counters.is_contiguous()
    return key, 0, counters.data_ptr()


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), n // MIN_THREAD_ELEMENTS))


def adamw_(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: Hyper,
           rounding: tuple[int, int | torch.Tensor] | None = None) -> None:
    """One AdamW update of a piece in place: ``grad`` (float32 or 16-bit, taken as float32, not yet multiplied by
    ``hyper.factor``) and
    float32 ``m``, ``v``; a 16-bit ``weight`` is rounded stochastically with ``rounding`` ``(key, counters)``."""
    n = weight.numel()
    if by_compiled(weight.device):
        compiled.adamw_(weight, grad, m, v, hyper, rounding)  # type: ignore[arg-type]
        return
    key, first, idx = _rounding(rounding, n)
    assert grad.numel() == n and grad.is_contiguous()
    for t in (m, v):
        assert t.numel() == n and t.is_contiguous() and t.dtype == torch.float32
    library().ipuft_adamw(n, weight.data_ptr(), MODES[weight.dtype], grad.data_ptr(), MODES[grad.dtype],
                          m.data_ptr(), v.data_ptr(),
                          ctypes.byref(hyper), key, first, idx, _threads(n), 1024)


def encode8_(codes: torch.Tensor, x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> None:
    """``codes`` (uint8) of the normalized float32 ``x`` as the kernel encodes them: by a map's table of buckets
    (the last of its :class:`~ipuft_optim_adamw8bit.quantize.Codebook`'s ``tables``)."""
    assert x.dtype == torch.float32 and codes.dtype == torch.uint8 and x.is_contiguous() and codes.is_contiguous()
    assert codes.numel() == x.numel()
    assert tables[3].numel() == WORDS and tables[3].dtype == torch.int32 and tables[3].is_contiguous()
    library().ipuft_encode8(x.numel(), x.data_ptr(), codes.data_ptr(), tables[3].data_ptr())


def adamw8bit_(weight: torch.Tensor, grad: torch.Tensor, codes: dict[str, torch.Tensor],
               absmax: dict[str, torch.Tensor], tables: dict[str, tuple[torch.Tensor, ...]], block: int,
               hyper: Hyper, rounding: tuple[int, int | torch.Tensor] | None = None) -> None:
    """:func:`adamw_` with block-wise 8-bit moments: uint8 ``codes`` and float32 ``absmax`` (one per block; the
    piece starts on a block boundary) of ``m`` and ``v``, each map's ``tables`` ``(values, base, bound, words)``
    (see :class:`ipuft_optim_adamw8bit.quantize.Codebook`): dequantized, updated and quantized again per block."""
    n = weight.numel()
    key, first, idx = _rounding(rounding, n)
    assert 1 <= block <= MAX_BLOCK and grad.numel() == n and grad.is_contiguous()
    for k in ("m", "v"):
        assert codes[k].numel() == n and codes[k].dtype == torch.uint8 and codes[k].is_contiguous()
        assert absmax[k].numel() == -(-n // block) and absmax[k].dtype == torch.float32 and absmax[k].is_contiguous()
    (m_values, *_, m_words), (v_values, *_, v_words) = tables["m"], tables["v"]
    for values, words in ((m_values, m_words), (v_values, v_words)):  # the kernel reads words[bits >> 15]
        assert values.numel() == 256 and values.dtype == torch.float32 and values.is_contiguous()
        assert words.numel() == WORDS and words.dtype == torch.int32 and words.is_contiguous()
    done = library().ipuft_adamw8bit(
        n, weight.data_ptr(), MODES[weight.dtype], grad.data_ptr(), MODES[grad.dtype], codes["m"].data_ptr(),
        codes["v"].data_ptr(),
        absmax["m"].data_ptr(), absmax["v"].data_ptr(), m_values.data_ptr(), v_values.data_ptr(), m_words.data_ptr(),
        v_words.data_ptr(), block, ctypes.byref(hyper), key, first, idx, _threads(n), 1024)
    assert done == 0
