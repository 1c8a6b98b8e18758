"""Host memory that a step frees stays in the process for the next one (``execution.retain_host_memory``), and
large tensors come in huge pages.

PyTorch's CPU tensors have no caching allocator (CUDA's has one): each is ``malloc``'d and ``free``'d, and
glibc gives memory back to the kernel eagerly. It serves a block above ``M_MMAP_THRESHOLD`` with a fresh
``mmap``, unmapped on free, and trims the heap's free top once it exceeds ``M_TRIM_THRESHOLD`` (both adapt
to the sizes seen, up to 32 MiB). The kernel then hands the memory back as zeroed pages, one page fault
per 4 KiB touched. A layer-major step allocates and frees the same large tensors for every micro-batch
and every step (a layer's activations and autograd's saved tensors, the logits, the gradients), and the
graphs kept by ``execution.recompute=false`` grow the heap and shrink it again each step, so with glibc's
defaults a ``recompute=false`` step faults in many thousands of pages afresh (docs/performance.md has the
counts), a few hundred with this.

:func:`retain_freed_memory` sets both thresholds once per process with ``mallopt``: blocks up to the
threshold come from the heap, and freed heap memory is kept for reuse, as a caching allocator would. The
process's resident memory then stays at its peak instead of falling between steps, which is what a step
needs again anyway. It is process-wide, like the allocator it tunes; elsewhere than glibc it does nothing.

At GPT-J-6B's width a step also makes and frees many tensors of hundreds of MB (an embedding's gradient is
0.8 GB), always mapped afresh: faulted in 4 KiB at a time, millions of page faults a step.
:func:`huge_pages_for_torch` asks torch's CPU allocator to back tensors of 2 MiB and more with transparent
huge pages (``THP_MEM_ALLOC_ENABLE=1``, which torch reads at its first allocation: the ``ipuft`` console
script sets it at start unless it is set), one fault per 2 MiB. With huge pages
the heap keeps only blocks under 2 MiB (:func:`heap_block_limit`): blocks of 2-32 MiB kept in the heap
fragment it (at micro-batch 4 it held far more than the step's tensors at its peak), while mapped
afresh in huge pages they cost little. The kernel must allow huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``madvise`` or ``always``); without them the heap keeps
blocks up to 32 MiB, as before.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest accepted M_MMAP_THRESHOLD on 64-bit
HUGE_PAGE = 2 * 1024 * 1024  # torch backs tensors from this size with transparent huge pages
TRIM_NEVER = 2**31 - 1  # an int's largest value: free heap memory is returned to the kernel only beyond 2 GiB
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def huge_pages_for_torch() -> None:
    """Transparent huge pages for torch's CPU tensors of 2 MiB and more, unless ``THP_MEM_ALLOC_ENABLE`` is set:
    effective only before torch's first CPU allocation in this process."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


@functools.cache
def huge_pages() -> bool:
    """Whether torch's large CPU tensors get transparent huge pages in this process: asked for, and allowed by
    the kernel."""
    if os.environ.get(HUGE_PAGES_ENV) != "1":
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def heap_block_limit() -> int:
    """The largest block the heap serves (and keeps, with :func:`retain_freed_memory`): under 2 MiB with huge
    pages, else up to 32 MiB."""
    return HUGE_PAGE if huge_pages() else MMAP_THRESHOLD_MAX


@functools.cache  # once per process
def retain_freed_memory() -> bool:
    """Keep freed host memory in the process for reuse; True once glibc has taken both settings."""
    return _mallopt({M_MMAP_THRESHOLD: heap_block_limit(), M_TRIM_THRESHOLD: TRIM_NEVER})


def _mallopt(settings: dict[int, int]) -> bool:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (ValueError, OSError, AttributeError):  # no such confstr name (not glibc), no symbol
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings.items())
