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

:func:`retain_freed_memory` sets both thresholds with ``mallopt`` (each engine, for its model): blocks up to the
threshold come from the heap, and freed heap memory is kept for reuse, as a caching allocator would. The
process's resident memory then stays at its peak instead of falling between steps, which is what a step
needs again anyway. It is process-wide, like the allocator it tunes; elsewhere than glibc it does nothing.

At GPT-J-6B's width a step also makes and frees many tensors of hundreds of MB (an embedding's gradient is
0.8 GB), always mapped afresh: faulted in 4 KiB at a time, millions of page faults a step.
:func:`huge_pages_for_torch` asks torch's CPU allocator to back tensors of 2 MiB and more with transparent
huge pages (``THP_MEM_ALLOC_ENABLE=1``, which torch reads at its first allocation: the ``ipuft`` console
script sets it at start unless it is set), one fault per 2 MiB. The kernel must allow huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``madvise`` or ``always``).

Which blocks the heap keeps then depends on the model's width (:func:`heap_block_limit`). A block mapped
afresh is zeroed by the kernel each time, a cost that is the same per byte at any width while the matmuls that
make and use the block grow with the hidden size. So a model narrower than :data:`WIDE` (hidden 2048) keeps
blocks up to 32 MiB in the heap, in huge pages still: SmolLM2-135M's no-recompute step (hidden 576, its
activations 2-5 MiB) ran 4-9% slower with them mapped afresh, and about as fast without huge pages. A wider
one keeps only blocks under 2 MiB: at GPT-J-6B's width blocks of 2-32 MiB kept in the heap fragment it (at
micro-batch 4 it held 0.5 GiB more than the step's tensors at its peak), while mapped afresh in huge pages they
cost little beside the matmuls. docs/performance.md has the figures.
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
WIDE = 2048  # the hidden size from which, with huge pages, the heap keeps only blocks under 2 MiB


def huge_pages_for_torch() -> None:
    """Transparent huge pages for torch's CPU tensors of 2 MiB and more, unless ``THP_MEM_ALLOC_ENABLE`` is set:
    effective only before torch's first CPU allocation in this process."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


@functools.cache
def huge_pages() -> bool:
    """Whether torch's large CPU tensors get transparent huge pages in this process: asked for, and allowed by
    the kernel."""
    return os.environ.get(HUGE_PAGES_ENV) == "1" and kernel_allows_huge_pages()


def kernel_allows_huge_pages() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks for them."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def heap_block_limit(hidden_size: int) -> int:
    """The largest block the heap serves (and keeps, with :func:`retain_freed_memory`) for a model of
    ``hidden_size``: up to 32 MiB, or under 2 MiB with huge pages from :data:`WIDE` on."""
    return HUGE_PAGE if huge_pages() and hidden_size >= WIDE else MMAP_THRESHOLD_MAX


def retain_freed_memory(hidden_size: int) -> bool:
    """Keep freed host memory in the process for reuse, the heap serving blocks up to
    :func:`heap_block_limit` of ``hidden_size`` (process-wide: the last engine built sets it); True once glibc
    has taken both settings."""
    return _mallopt({M_MMAP_THRESHOLD: heap_block_limit(hidden_size), M_TRIM_THRESHOLD: TRIM_NEVER})


def _mallopt(settings: dict[int, int]) -> bool:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (ValueError, OSError, AttributeError):  # no such confstr name (not glibc), no symbol
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings.items())
