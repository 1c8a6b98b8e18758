"""execution.retain_host_memory: freed host memory stays in the process, so reused tensors do not page-fault."""

import os
import subprocess
import sys

import pytest

from ipuft.hostmem import kernel_allows_huge_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
    reason="tunes glibc's malloc")

# Run in a fresh process each (the setting is process-wide): whether glibc took the setting, how many MiB
# of a 16 MiB tensor it mapped outside its heap (mallinfo2's hblkhd), and the page faults of rounds 4-8 of
# allocating, filling and freeing 64 tensors of 1 MiB (the heap grows by 64 MiB each round and, by glibc's
# defaults, may be trimmed again, like a layer-major step's activations).
PROBE = """
import ctypes, resource, sys, torch
from ipuft.hostmem import retain_freed_memory
retained = retain_freed_memory(int(sys.argv[2])) if sys.argv[1] == "retain" else False

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
before = mallinfo2().hblkhd
block = torch.empty(4 << 20)
mapped = (mallinfo2().hblkhd - before) >> 20
del block

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

for round_ in range(8):
    if round_ == 3:
        start = faults()
    tensors = [torch.empty(1 << 18).fill_(1.0) for _ in range(64)]
    del tensors
print(retained, mapped, faults() - start)
"""


def probe(mode: str, huge_pages: bool = False, hidden_size: int = 4096) -> tuple[str, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    env["THP_MEM_ALLOC_ENABLE"] = "1" if huge_pages else "0"
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(hidden_size)], capture_output=True, text=True,
                         env=env, check=True)
    retained, mapped, faults = out.stdout.split()
    return retained, int(mapped), int(faults)


def test_retained_memory_comes_from_the_heap_and_is_reused_without_page_faults():
    assert probe("default")[:2] == ("False", 16)  # glibc maps a fresh 16 MiB block, and unmaps it when freed
    retained, mapped, faults = probe("retain")
    assert (retained, mapped) == ("True", 0)
    assert faults <= 0.02 * 5 * 64 * 256  # of 5 rounds' 64 MiB, in 4 KiB pages: nothing faults in again


@pytest.mark.skipif(not kernel_allows_huge_pages(), reason="this kernel allows no transparent huge pages")
def test_with_huge_pages_a_wide_models_heap_keeps_only_blocks_under_2_mib(monkeypatch):
    """torch backs its tensors of 2 MiB and more with transparent huge pages: for a model of hidden 2048 or more
    those are mapped afresh (the 16 MiB block), where a fault costs little beside its matmuls, and the heap keeps
    the smaller ones (the 1 MiB tensors do not fault again), so that blocks of 2-32 MiB do not fragment it."""
    from ipuft.hostmem import HUGE_PAGE, MMAP_THRESHOLD_MAX, WIDE, heap_block_limit, huge_pages

    retained, mapped, faults = probe("retain", huge_pages=True, hidden_size=WIDE)
    assert (retained, mapped) == ("True", 16)
    assert faults <= 0.02 * 5 * 64 * 256
    huge_pages.cache_clear()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    try:
        assert (heap_block_limit(WIDE), heap_block_limit(WIDE - 1)) == (HUGE_PAGE, MMAP_THRESHOLD_MAX)
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
        huge_pages.cache_clear()
        assert heap_block_limit(WIDE) == MMAP_THRESHOLD_MAX
    finally:
        huge_pages.cache_clear()


@pytest.mark.skipif(not kernel_allows_huge_pages(), reason="this kernel allows no transparent huge pages")
def test_with_huge_pages_a_narrow_models_heap_keeps_blocks_up_to_32_mib():
    """Below hidden 2048 a block mapped afresh (zeroed by the kernel each time) costs more beside its matmuls than
    the heap's fragmentation: the 16 MiB block comes from the heap, in huge pages still."""
    from ipuft.hostmem import WIDE

    retained, mapped, faults = probe("retain", huge_pages=True, hidden_size=WIDE - 1)
    assert (retained, mapped) == ("True", 0)
    assert faults <= 0.02 * 5 * 64 * 256


def test_the_engine_retains_host_memory_unless_told_not_to(hooks, make_config, monkeypatch):
    import ipuft.engine.stored
    from ipuft.engine.model import build_model

    calls = []
    monkeypatch.setattr(ipuft.engine.stored, "retain_freed_memory", calls.append)
    for retain in (True, False):
        cfg = make_config(f"execution.retain_host_memory={retain}")
        ipuft.engine.stored.StoredModel(cfg, build_model(cfg, hooks), "cpu")
    assert calls == [cfg.model.hidden_size]


@pytest.mark.skipif(not kernel_allows_huge_pages(), reason="this kernel allows no transparent huge pages")
def test_the_plan_counts_the_blocks_the_models_heap_keeps(hooks, make_config, monkeypatch):
    """The plan's heap share (UnitCost.heap_peak_bytes) follows the engine's rule: with huge pages a wide model's
    blocks of 2 MiB and more (hidden 2048: a micro-batch's hidden states) are mapped afresh and not counted, a
    narrow one's (hidden 1024, the same 2 MiB) stay in the heap and are."""
    from ipuft.engine.model import build_model
    from ipuft.hostmem import huge_pages
    from ipuft.plan.measure import unit_cost

    def heap_peak(hidden: int, seq: int, thp: str) -> int:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", thp)
        huge_pages.cache_clear()
        cfg = make_config(f"model.hidden_size={hidden}", f"model.sequence_length={seq}",
                          "execution.micro_batch_size=1", "training.global_batch_size=1")
        return unit_cost(build_model(cfg, hooks), "decoder", cfg).heap_peak_bytes

    try:
        wide, narrow = [(heap_peak(h, s, "1"), heap_peak(h, s, "0")) for h, s in ((2048, 256), (1024, 512))]
    finally:
        huge_pages.cache_clear()
    assert wide[0] < 2 * 2**20 < 32 * 2**20 < wide[1], wide  # 1.0 MB of small blocks against 48.8 MB of all
    assert narrow[0] == narrow[1] > 32 * 2**20, narrow  # every block counted, huge pages or not
