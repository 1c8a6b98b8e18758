"""What the variable store (:mod:`ipuft.engine.store`) counts, and only it: the bytes moved between the host and
the compute device per category (:class:`Traffic`), and the bytes held on the device with their peaks
(:class:`DeviceLedger`). The rest of the engine counts through the store's ``hold``/``free``/``holding``,
``bring``/``brought`` and ``send``/``sent``; ``ipuft plan`` declares the same figures."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Traffic:
    """Bytes moved between host and compute device, per category (a variable group, ``activation``,
    ``data``), in each direction."""

    h2d: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    d2h: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def h2d_bytes(self) -> int:
        return sum(self.h2d.values())

    @property
    def d2h_bytes(self) -> int:
        return sum(self.d2h.values())

    def copy(self) -> Traffic:
        """The counts so far, to take :meth:`since` from."""
        return Traffic(defaultdict(int, self.h2d), defaultdict(int, self.d2h))

    def since(self, before: Traffic) -> Traffic:
        """The bytes moved since ``before`` (a :meth:`copy`), per category."""
        return Traffic(defaultdict(int, {k: v - before.h2d.get(k, 0) for k, v in self.h2d.items()}),
                       defaultdict(int, {k: v - before.d2h.get(k, 0) for k, v in self.d2h.items()}))

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"h2d": dict(self.h2d), "d2h": dict(self.d2h)}


class DeviceLedger:
    """Bytes the engine holds on the compute device, and their peak since the last reset."""

    def __init__(self) -> None:
        self.resident = 0
        self.peak = 0
        self._host = 0  # > 0 inside on_host(): what is acquired is host memory
        self.phase_peaks: dict[str, int] = {}  # each phase's most bytes above what was resident as it began

    def acquire(self, n: int) -> None:
        if self._host:
            return
        self.resident += n
        self.peak = max(self.peak, self.resident)

    def release(self, n: int) -> None:
        if not self._host:
            self.resident -= n

    @contextmanager
    def on_host(self) -> Iterator[None]:
        """Work in the block runs in host memory (``execution.optimizer_placement=host``): the temporaries it
        acquires and releases are not device bytes and are not counted."""
        self._host += 1
        try:
            yield
        finally:
            self._host -= 1

    def reset_peak(self) -> None:
        self.peak = self.resident
        self.phase_peaks = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the block's (a phase's) peak above what was resident as it began, as ``phase_peaks[name]``:
        what ``ipuft plan`` declares the phase holds (:class:`ipuft.plan.memory.PhaseMemory`)."""
        start, outer = self.resident, self.peak
        self.peak = self.resident
        try:
            yield
        finally:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.peak - start)
            self.peak = max(outer, self.peak)
