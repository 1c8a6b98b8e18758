"""Whether this machine computes the run's precision fast, checked before a command computes.

A CPU without native 16-bit matmul kernels (AVX-512 BF16 or AMX for bfloat16, AVX-512 FP16 or AMX-FP16
for float16) runs torch's 16-bit matmuls in a generic loop, orders of magnitude slower than float32, so a
step of a 16-bit run takes far longer than the float32 one (figures: docs/performance.md). Whether
it does depends on the CPU and on the torch build, so it is measured, not guessed: a short matmul probe in
float32 and in the 16-bit dtype (a fraction of a second, a few tenths on a slow CPU), cached per machine
(CPU model, its flags, threads and the torch version) in ``kernels.json`` under the data cache's directory.
A run whose 16-bit rate is under half the float32 rate gets one warning line from ``plan``, ``train``,
``bench``, ``eval`` and ``generate``, with both rates and the suggestion ``model.precision=float32``. The
fine-tuning recipe of a checkpoint (:mod:`ipuft.config.recipe`) asks the same question to choose bfloat16 or
float32 (:func:`fast_bfloat16`).

On CUDA nothing is measured: a device without bfloat16 arithmetic (compute capability under 8.0) is
refused, in one line, before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from ipuft.errors import CheckpointError, ConfigError
from ipuft.io.files import read_json
from ipuft.precision import compute_dtype

PROBE = 384  # an n × n × n matmul: 113 MFLOP, under a millisecond in float32 on one modern core
SLOW = 0.5  # a 16-bit rate under this share of the float32 rate gets the warning
CACHE_FILE = "kernels.json"
_CACHE_LIMIT = 1 << 20  # bytes: a few entries of a few rates
# FLOP/s a cached rate may be: from 1 MFLOP/s (slower, the probe would take minutes) to 10 PFLOP/s, beyond any
# CPU; a rate outside is impossible, not measured, so it is measured again.
RATE_RANGE = (1e6, 1e16)


def compute_device(cfg: DictConfig) -> torch.device:
    """The device the run computes on (``execution.device``; ``auto``: CUDA when there is one), as the plan
    sees it (device 0)."""
    cuda = cfg.execution.device.value != "cpu" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def cpu_identity() -> str:
    """What the probe's result depends on: the CPU (model and flags), the threads torch uses, torch's version
    and the CPU capability its kernels were chosen for."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:16]
    return (f"{model}|{digest}|threads {torch.get_num_threads()}|torch {torch.__version__}|"
            f"{torch.backends.cpu.get_cpu_capability()}")


def probe_rate(dtype: torch.dtype, n: int = PROBE) -> float:
    """FLOP/s of an ``n × n × n`` matmul in ``dtype`` on the CPU: the best of three after a warm-up."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / max(best, 1e-9)


def _cache_path() -> Path:
    from ipuft.paths import cache_root

    return cache_root() / CACHE_FILE


def _read_cache(path: Path) -> dict:
    """The cache file's entries; whatever is not ``{identity: {dtype: possible rate}}`` (:data:`RATE_RANGE`) is
    dropped, and a file that is not a regular one (:mod:`ipuft.io.files`), too large or not JSON is read as none:
    the file is only an accelerator, so a bad one is measured again and rewritten."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        data = read_json(path, _CACHE_LIMIT, str(path))
    except CheckpointError:  # not a regular file (a FIFO is never waited on), too large, not JSON
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: rates for key, rates in data.items()
            if isinstance(rates, dict) and all(map(_possible, rates.values()))}


def _possible(rate: object) -> bool:
    """Whether ``rate`` is a rate one CPU's matmul can have: a float within :data:`RATE_RANGE`."""
    return isinstance(rate, float) and RATE_RANGE[0] <= rate <= RATE_RANGE[1]


def _write_cache(path: Path, entries: dict) -> None:
    """Write the cache atomically; a cache directory that cannot be written only costs the next probe."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)
    except OSError:
        pass


def measured_rates(dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    """This CPU's matmul rate (FLOP/s) in each of ``dtypes``, from the cache, else probed and cached."""
    path, identity = _cache_path(), cpu_identity()
    entries = _read_cache(path)
    rates = dict(entries.get(identity, {}))
    missing = [d for d in dtypes if _name(d) not in rates]
    if missing:
        rates.update({_name(d): probe_rate(d) for d in missing})
        entries[identity] = rates
        _write_cache(path, entries)
    return {_name(d): rates[_name(d)] for d in dtypes}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_rates(dtype: torch.dtype) -> tuple[float, float, bool]:
    """This CPU's float32 and ``dtype`` matmul rates, and whether ``dtype`` is fast (at least :data:`SLOW` of
    the float32 rate)."""
    rates = measured_rates((torch.float32, dtype))
    wide, narrow = rates["float32"], rates[_name(dtype)]
    return wide, narrow, narrow >= SLOW * wide


def fast_bfloat16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 fast, and why, in words: a CUDA device of compute capability 8.0 or
    newer has bfloat16 arithmetic; a CPU is measured (the probe, cached)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        has = "has" if major >= 8 else "has no"
        return major >= 8, (f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}, {has} "
                            f"bfloat16 arithmetic")
    wide, narrow, fast = _cpu_rates(torch.bfloat16)
    return fast, (f"this CPU multiplies bfloat16 matrices at {narrow / 1e9:,.1f} GFLOP/s against "
                  f"{wide / 1e9:,.1f} GFLOP/s in float32")


def slow_precision_warning(cfg: DictConfig, device: torch.device) -> str | None:
    """One warning line when the run computes 16-bit on a CPU whose 16-bit matmuls are slow, else ``None``."""
    dtype = compute_dtype(cfg)
    if device.type != "cpu" or dtype == torch.float32:
        return None
    wide, narrow, fast = _cpu_rates(dtype)
    if fast:
        return None
    return (f"model.precision={_name(dtype)}: this CPU ({torch.backends.cpu.get_cpu_capability()}) multiplies "
            f"{_name(dtype)} matrices at {narrow / 1e9:,.1f} GFLOP/s against {wide / 1e9:,.1f} GFLOP/s in float32 "
            f"(no native {_name(dtype)} kernels), so a step would take about {wide / narrow:,.0f}x as long as in "
            f"float32; set model.precision=float32")


def require_precision_support(cfg: DictConfig, device: torch.device) -> None:
    """Refuse, in one line, a dtype the CUDA device cannot compute in: bfloat16 needs compute capability 8.0."""
    if device.type != "cuda" or compute_dtype(cfg) != torch.bfloat16:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ConfigError(f"model.precision=bfloat16: {torch.cuda.get_device_name(device)} (compute capability "
                          f"{major}.{minor}) has no bfloat16 arithmetic, which needs 8.0 or newer; use "
                          f"model.precision=float16 with execution.loss_scaling=dynamic, or float32")
