"""execution.retain_host_memory: freed host memory stays in the process, so reused tensors do not page-fault."""

import os
import subprocess
import sys

import pytest

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
retained = retain_freed_memory() if sys.argv[1] == "retain" else False

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


def probe(mode: str, huge_pages: bool = False) -> tuple[str, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    env["THP_MEM_ALLOC_ENABLE"] = "1" if huge_pages else "0"
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    retained, mapped, faults = out.stdout.split()
    return retained, int(mapped), int(faults)


def test_retained_memory_comes_from_the_heap_and_is_reused_without_page_faults():
    assert probe("default")[:2] == ("False", 16)  # glibc maps a fresh 16 MiB block, and unmaps it when freed
    retained, mapped, faults = probe("retain")
    assert (retained, mapped) == ("True", 0)
    assert faults <= 0.02 * 5 * 64 * 256  # of 5 rounds' 64 MiB, in 4 KiB pages: nothing faults in again


def test_with_huge_pages_the_heap_keeps_only_blocks_under_2_mib(monkeypatch):
    """torch backs its tensors of 2 MiB and more with transparent huge pages: those are mapped afresh (the 16 MiB
    block), where a fault costs little, and the heap keeps the smaller ones (the 1 MiB tensors do not fault
    again), so that blocks of 2-32 MiB do not fragment it."""
    from ipuft.hostmem import HUGE_PAGE, heap_block_limit, huge_pages

    if "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():  # noqa: SIM115
        pytest.skip("this kernel allows no transparent huge pages")
    retained, mapped, faults = probe("retain", huge_pages=True)
    assert (retained, mapped) == ("True", 16)
    assert faults <= 0.02 * 5 * 64 * 256
    huge_pages.cache_clear()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    try:
        assert heap_block_limit() == HUGE_PAGE
    finally:
        huge_pages.cache_clear()


def test_the_engine_retains_host_memory_unless_told_not_to(hooks, make_config, monkeypatch):
    import ipuft.engine.stored
    from ipuft.engine.model import build_model

    calls = []
    monkeypatch.setattr(ipuft.engine.stored, "retain_freed_memory", lambda: calls.append(1))
    for retain in (True, False):
        cfg = make_config(f"execution.retain_host_memory={retain}")
        ipuft.engine.stored.StoredModel(cfg, build_model(cfg, hooks), "cpu")
    assert calls == [1]
