"""The variable store: every variable of the model in host memory (the reference's remote buffers).

Variables are kept per unit (``embeddings``, ``decoder.<n>``, ``head``) and per group:

- ``fwd``: the weights;
- ``optim``: the optimizer state;
- ``grad``: the accumulated gradients, between the backward and the optimizer phases.

A phase :meth:`~VariableStore.load`\\ s what it needs onto the compute device and
:meth:`~VariableStore.save`\\ s back what it changed. :class:`Traffic` counts the bytes moved in each
direction, and :class:`DeviceLedger` the bytes resident on the compute device and their peak.

With ``offload=False`` the variables live on the compute device: loads hand out the stored tensors
themselves and saves are no-ops, so the same program runs with no traffic.

On a CPU compute device host memory *is* device memory, so with offload on a load lends the stored tensors
instead of copying them within the one memory, and a save has nothing to copy back for them (CUDA copies
for real). The counters and the ledger still count what the program moves and holds, the bytes a separate
device would see, so that they equal ``ipuft plan``'s on any machine; only the memcpys are skipped.

Wherever the variables live in the compute device's memory (offload off, or lent), a save of a fresh
tensor (a gradient) keeps that tensor as the stored one instead of copying it into the old.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ipuft.components import VariableSpec
from ipuft.engine.counters import DeviceLedger, Traffic
from ipuft.profiling import section

Tensors = dict[str, torch.Tensor]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def storage_bytes(tensors: Iterable[torch.Tensor], excluded: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of the storages under ``tensors``, each counted once (views share theirs), but for those of
    ``excluded``; fake tensors' too."""
    seen = {StorageWeakRef(t.untyped_storage()).cdata for t in excluded}
    sizes = {}
    for t in tensors:
        key = StorageWeakRef(t.untyped_storage()).cdata
        if key not in seen:
            sizes[key] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def _replaceable(stored: torch.Tensor, fresh: torch.Tensor) -> bool:
    """``fresh`` can be kept as the stored variable: same shape, dtype and memory, and a whole tensor of its
    own (not a view that would keep a larger one alive)."""
    return (fresh.shape == stored.shape and fresh.dtype == stored.dtype and fresh.device == stored.device
            and fresh._base is None and fresh.is_contiguous() and not fresh.requires_grad)


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``tensor`` in host memory: pinned, and copied asynchronously, with ``pin`` (CUDA)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return host.copy_(tensor, non_blocking=pin)


class VariableStore:
    """Host-resident variables, loaded to and saved from the compute device phase by phase."""

    def __init__(self, compute: torch.device, offload: bool = True) -> None:
        self.compute = torch.device(compute)
        self.offload = offload
        self.home = torch.device("cpu") if offload else self.compute
        # Host memory is the compute device's (a CPU device): loads lend the stored tensors, saves copy nothing.
        self.lends = offload and self.compute.type == "cpu"
        # Pinned host memory makes host↔device copies asynchronous on CUDA.
        self.pin = offload and self.compute.type == "cuda"
        self.entries: dict[str, dict[str, Tensors]] = defaultdict(dict)
        self._traffic = Traffic()
        self._ledger = DeviceLedger()
        self._copy_stream = torch.cuda.Stream(self.compute) if self.pin else None
        self._prefetched: dict[tuple[str, str], tuple[Tensors, torch.cuda.Event]] = {}

    # ---- allocation ----

    def allocate(self, unit: str, group: str, specs: list[VariableSpec]) -> None:
        """Create ``unit``'s ``group`` variables in their home memory, filled by their specs' inits."""
        self.put(unit, group, {s.name: s.init.fill_(torch.empty(s.shape, dtype=s.dtype)) for s in specs})

    def put(self, unit: str, group: str, tensors: Tensors) -> None:
        """Keep ``tensors`` as ``unit``'s ``group``, moved to their home memory (pinned for CUDA)."""
        home = {}
        for name, tensor in tensors.items():
            t = tensor.to(self.home)
            home[name] = t.pin_memory() if self.pin else t
        self.entries[unit][group] = home
        if not self.offload:
            self.hold(nbytes(home.values()))

    def variable_bytes(self) -> int:
        """Bytes of every variable this rank stores, wherever they live."""
        return sum(nbytes(t.values()) for groups in self.entries.values() for t in groups.values())

    def host_bytes(self) -> int:
        """Bytes of every variable held in host memory (0 with offload off)."""
        return self.variable_bytes() if self.offload else 0

    # ---- phase I/O ----

    def load(self, unit: str, group: str, names: Collection[str] | None = None) -> Tensors:
        """``unit``'s ``group`` (only ``names`` of it, when given) on the compute device: a copy when
        offloaded, the variables themselves otherwise."""
        stored = self.entries[unit][group]
        if names is not None:
            stored = {n: t for n, t in stored.items() if n in names}
        if not self.offload:
            return stored
        if self.lends:
            self._count_load(group, stored)
            return stored
        if (unit, group) in self._prefetched:
            out, ready = self._prefetched.pop((unit, group))
            current = torch.cuda.current_stream(self.compute)
            current.wait_event(ready)
            for t in out.values():
                t.record_stream(current)  # allocated on the copy stream, used on this one
            return out
        with section("copies"):
            out = {name: t.to(self.compute, non_blocking=self.pin, copy=True) for name, t in stored.items()}
        self._count_load(group, out)
        return out

    def prefetch(self, unit: str, group: str, names: Collection[str] | None = None) -> None:
        """On CUDA, start copying ``unit``'s ``group`` (only ``names``, when given) to the device on a side
        stream (the analogue of the reference's IO tiles); the next :meth:`load` of it, with the same
        ``names``, waits for the copy. A no-op elsewhere."""
        if self._copy_stream is None or (unit, group) in self._prefetched or group not in self.entries[unit]:
            return
        self.after_compute()  # everything enqueued so far, earlier phases' stores into host memory included, first
        with section("copies"), torch.cuda.stream(self._copy_stream):
            out = {n: t.to(self.compute, non_blocking=True, copy=True) for n, t in self.entries[unit][group].items()
                   if names is None or n in names}
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        self._count_load(group, out)
        self._prefetched[(unit, group)] = (out, ready)

    def after_compute(self) -> None:
        """The side copies that follow wait for everything enqueued so far on the compute stream (earlier
        phases' stores into host memory land first; CUDA, a no-op elsewhere)."""
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.compute))

    @contextmanager
    def beside_compute(self) -> Iterator[list[torch.cuda.Event]]:
        """The block's copies run on the side copy stream (CUDA; elsewhere the block just runs); the list it
        gives holds, after the block, the event that marks them done (empty without a side stream)."""
        if self._copy_stream is None:
            yield []
            return
        done: list[torch.cuda.Event] = []
        with torch.cuda.stream(self._copy_stream):
            yield done
            done.append(torch.cuda.Event())
            done[0].record(self._copy_stream)

    def _count_load(self, group: str, tensors: Tensors) -> None:
        self.brought(group, nbytes(tensors.values()))

    def save(self, unit: str, group: str, tensors: Tensors) -> None:
        """Write ``tensors`` (on the compute device, loaded or created by the phase) back as ``unit``'s
        ``group``. Where the variables live in the compute device's memory, a fresh tensor the phase no longer
        uses (a gradient) replaces the stored one instead of being copied into it."""
        stored = self.entries[unit][group]
        moved = {n: t for n, t in tensors.items() if stored[n] is not t}
        in_place = not self.offload or self.lends
        with section("copies"):
            for name, t in moved.items():
                if in_place and _replaceable(stored[name], t):
                    stored[name] = t
                else:
                    stored[name].copy_(t, non_blocking=self.pin)
        if self.offload:  # lent tensors changed in place count as moved back, as copies would be
            self.sent(group, nbytes((tensors if self.lends else moved).values()))

    def release(self, tensors: Tensors) -> None:
        """The phase is done with ``tensors``, which it loaded: with offload each was counted on the device when
        it came (copied or lent); without, they are the stored variables, counted for as long as they live."""
        if self.offload:
            self.free(nbytes(tensors.values()))

    # ---- moving and counting: every byte the engine holds on the device or moves is counted here ----

    def hold(self, n: int) -> None:
        """``n`` more bytes held on the compute device (made there; a negative ``n`` gives bytes back)."""
        self._ledger.acquire(n)

    def free(self, n: int) -> None:
        """``n`` bytes that :meth:`hold`, :meth:`bring` or :meth:`brought` counted are gone from the device."""
        self._ledger.release(n)

    @contextmanager
    def holding(self, n: int) -> Iterator[None]:
        """``n`` transient bytes held on the device for the block."""
        self.hold(n)
        try:
            yield
        finally:
            self.free(n)

    def brought(self, category: str, n: int, held: bool = True) -> None:
        """The caller copied ``n`` bytes of ``category`` to the device: counted host→device and, ``held``, as
        device bytes until freed."""
        self._traffic.h2d[category] += n
        if held:
            self._ledger.acquire(n)

    def sent(self, category: str, n: int) -> None:
        """The caller copied ``n`` bytes of ``category`` to the host: counted device→host."""
        self._traffic.d2h[category] += n

    def bring(self, tensor: torch.Tensor, category: str, copy: bool = True, held: bool = True) -> torch.Tensor:
        """``tensor`` (in host memory) on the compute device, counted as :meth:`brought`; ``copy=False``: the
        tensor itself where it already is there (a CPU device)."""
        with section("copies"):
            out = tensor.to(self.compute, non_blocking=self.compute.type == "cuda", copy=copy)
        self.brought(category, tensor.numel() * tensor.element_size(), held)
        return out

    def send_into(self, host: torch.Tensor, tensor: torch.Tensor, category: str) -> None:
        """Copy ``tensor`` (on the device) into ``host`` (asynchronously on CUDA), counted as :meth:`sent`; nothing
        is copied where they are one tensor (lent host memory), but the bytes count as moved back."""
        if host is not tensor:
            with section("copies"):
                host.copy_(tensor, non_blocking=self.pin)
        self.sent(category, host.numel() * host.element_size())

    def send(self, tensor: torch.Tensor, category: str, copy: bool = True) -> torch.Tensor:
        """A copy of ``tensor`` in host memory (pinned and asynchronous on CUDA), counted as :meth:`sent`;
        ``copy=False``: the tensor itself where it already is there (a CPU device)."""
        out = tensor
        if copy or tensor.device.type != "cpu":
            with section("copies"):
                out = host_copy(tensor, self.compute.type == "cuda")
        self.sent(category, tensor.numel() * tensor.element_size())
        return out

    def on_host(self):
        """Work in the block runs in host memory (:meth:`DeviceLedger.on_host`): not counted on the device."""
        return self._ledger.on_host()

    def traffic(self) -> Traffic:
        """The bytes moved so far, per category (a copy: take :meth:`Traffic.since` from it)."""
        return self._traffic.copy()

    # ---- what a step holds on the device (the ledger's record, for StepResult) ----

    @property
    def device_resident(self) -> int:
        """The bytes counted on the compute device now."""
        return self._ledger.resident

    @property
    def device_peak(self) -> int:
        """The most bytes counted on the compute device since the last :meth:`reset_peak`."""
        return self._ledger.peak

    def reset_peak(self) -> None:
        """The device peak and the phases' peaks are recorded afresh from here."""
        self._ledger.reset_peak()

    def begin_step(self) -> None:
        """A step starts: its device peak and its phases' peaks are recorded afresh."""
        self.reset_peak()

    def phase(self, name: str):
        """The block is phase ``name``: its peak above what it found is recorded (:meth:`DeviceLedger.phase`)."""
        return self._ledger.phase(name)

    def step_peaks(self) -> tuple[int, dict[str, int]]:
        """The step's device peak so far, and each phase's peak above what it found, in bytes."""
        return self._ledger.peak, dict(self._ledger.phase_peaks)

    def synchronize(self) -> None:
        """Wait for outstanding asynchronous copies (CUDA), so host values are final."""
        if self.compute.type == "cuda":
            torch.cuda.synchronize(self.compute)

    # ---- whole-model views ----

    def state(self, group: str = "fwd") -> dict[str, Tensors]:
        """Every unit's ``group`` tensors, as stored (host tensors when offloaded)."""
        self.synchronize()
        return {unit: groups[group] for unit, groups in self.entries.items() if group in groups}
