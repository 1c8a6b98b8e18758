"""The batch-serialisation buffers ``x[L+1][GA]`` and ``dx[L+1][GA]``, and working-set accounting.

Row ``n`` of ``x`` holds the input of decoder layer ``n`` for each micro-batch (row ``L`` is the head's
input); ``dx`` holds the gradients flowing back through the same boundaries. Only these layer inputs
survive between phases; everything else is recomputed. The buffers sit on the compute device, or in
host memory with ``execution.activation_offload=true``, in the compute dtype. With ``disk``, they are in
host memory as with ``true``, but each ``x`` entry a later forward reads is also written to disk
(:mod:`ipuft.engine.spill`) and dropped from memory once that forward has read it; the backward's read
takes it back from the reader thread, which reads a row ahead. Under tensor parallelism
every TP rank holds the same activations, so each stores only its 1/TP slice of every entry (the
reference's ``get_activ_shard_group``) and a read all-gathers the entry over the TP group.

An entry lives from its write until its consumer is done with it, so ``dx`` never holds more than the
rows in flight: the backward of layer ``n`` consumes ``x[n]`` and ``dx[n+1]`` as it writes ``dx[n]``. The
peak is the ``(L+1)·GA`` entries of ``x`` at the end of the forward (the reference allocates ``L+1`` rows
of each of ``x`` and ``dx``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ipuft.engine.spill import SpillFiles
from ipuft.engine.store import VariableStore
from ipuft.parallel import Layout, all_gather_flat
from ipuft.profiling import section

KINDS = ("x", "dx")


@dataclass
class Spill:
    """Where and what ``activation_offload=disk`` spills: the ``x`` ``rows`` (:func:`ipuft.engine.spill.spilled_rows`)
    of ``micro_batches`` entries each, ``step_bytes`` in all, into this rank's directory under ``root``."""

    root: Path
    rows: frozenset[int]
    micro_batches: int
    step_bytes: int
    rank: int = 0
    ranks_here: int = 1  # ranks sharing this machine's disk, for the free-space check


class ActivationBuffers:
    """``x`` and ``dx`` rows of ``GA`` micro-batches each, on the device, offloaded to the host, or (``spill``)
    with the ``x`` rows a later forward reads on disk."""

    def __init__(self, store: VariableStore, offload: bool, layout: Layout | None = None,
                 spill: Spill | None = None) -> None:
        self.store = store
        self.offload = bool(offload) or spill is not None
        self.layout = layout or Layout()
        self.spill = spill
        self.files: SpillFiles | None = None  # opened at the first spilled write
        self._dropped = 0  # spilled entries this step whose in-memory copy is gone
        # Pinned host buffers make the copies asynchronous on CUDA, whether or not variables are offloaded.
        self.pin = self.offload and store.compute.type == "cuda"
        self._slots: dict[tuple[str, int, int], torch.Tensor] = {}
        self._shapes: dict[tuple[str, int, int], torch.Size] = {}
        self.live = 0  # bytes of buffered activations (host or device), counted until a consumer is done
        self.peak = 0  # their peak since the last clear()

    def write(self, kind: str, row: int, mb: int, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (on the compute device) as ``kind[row][mb]``: this TP rank's slice of it."""
        self._shapes[(kind, row, mb)] = tensor.shape
        tp = self.layout.tensor_parallel
        if tp > 1:
            tensor = tensor.reshape(-1).chunk(tp)[self.layout.tp_rank].clone()
        size = tensor.numel() * tensor.element_size()
        if self.offload:
            tensor = self.store.send(tensor, "activation")
        else:
            self.store.hold(size)
        self._slots[(kind, row, mb)] = tensor.detach()
        self.live += size
        if self._spilled((kind, row, mb)):
            self._open().put((kind, row, mb), tensor, self._copied())
        self._count_peak()

    def _spilled(self, key: tuple[str, int, int]) -> bool:
        return self.spill is not None and key[0] == "x" and key[1] in self.spill.rows

    def _open(self) -> SpillFiles:
        if self.files is None:
            s = self.spill
            self.files = SpillFiles(s.root, s.rank, s.step_bytes, s.micro_batches, s.ranks_here, self.pin)
        return self.files

    def _copied(self) -> torch.cuda.Event | None:
        """On CUDA, an event the writer waits for: the asynchronous copy into the pinned host buffer is done."""
        if not self.pin:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _count_peak(self) -> None:
        self.peak = max(self.peak, self.live + (self.files.pending_bytes() if self.files is not None else 0))

    @contextmanager
    def read(self, kind: str, row: int, mb: int, consume: bool = False) -> Iterator[torch.Tensor]:
        """``kind[row][mb]`` on the compute device for the duration of the block; ``consume`` frees it."""
        key = (kind, row, mb)
        spilled = self._spilled(key)
        from_disk = spilled and key not in self._slots
        if from_disk:  # the backward's read: taken from the reader, gone from disk
            with section("copies"):
                stored = self.files.take(key)
            self.live += stored.numel() * stored.element_size()
            self._count_peak()
        else:
            # The forward's read of a spilled entry is its last in memory: the disk holds it from here.
            stored = self._slots.pop(key) if consume or spilled else self._slots[key]
        shape = self._shapes.pop(key) if consume else self._shapes[key]
        size = stored.numel() * stored.element_size()
        tensor = self.store.bring(stored, "activation") if self.offload else stored
        gathered = 0
        if self.layout.tensor_parallel > 1:
            full = tensor.new_empty(size * self.layout.tensor_parallel // tensor.element_size())
            with section("collectives"):
                all_gather_flat(full, tensor, group=self.layout.tp_group)
            tensor, gathered = full.view(shape), size * self.layout.tensor_parallel
            self.store.hold(gathered)
        try:
            yield tensor
        finally:
            self.store.free(gathered)
            if self.offload or consume:
                self.store.free(size)
            if consume or spilled:
                self.live -= size
            if from_disk:
                self.files.done()
            elif spilled and not consume:
                self._forward_read()

    def _forward_read(self) -> None:
        """A spilled entry's in-memory copy is gone; after the last, the reader starts on the backward's order:
        rows from the last down, micro-batches in order."""
        self._dropped += 1
        if self._dropped == len(self.spill.rows) * self.spill.micro_batches:
            self.files.schedule([("x", row, mb) for row in sorted(self.spill.rows, reverse=True)
                                 for mb in range(self.spill.micro_batches)])

    def spilled_bytes(self) -> tuple[int, int]:
        """The bytes this step wrote to and read from disk."""
        return (self.files.written, self.files.read) if self.files is not None else (0, 0)

    def clear(self) -> None:
        """Drop every buffered activation (the end of a step)."""
        if not self.offload:
            self.store.free(sum(t.numel() * t.element_size() for t in self._slots.values()))
        self._slots.clear()
        self._shapes.clear()
        self.live = self.peak = self._dropped = 0
        if self.files is not None:
            self.files.end_step()

    def close(self) -> None:
        """Stop spilling and remove this rank's spill directory (nothing to do without ``spill``)."""
        if self.files is not None:
            self.files.close()
            self.files = None

    def __len__(self) -> int:
        return len(self._slots)


class Saved:
    """The bytes of tensors autograd saved inside a :func:`working_set` block."""

    def __init__(self) -> None:
        self.bytes = 0


@contextmanager
def working_set(store: VariableStore, exclude: list[torch.Tensor], keep: bool = False) -> Iterator[Saved]:
    """Count the tensors autograd saves for the backward as resident device bytes while the block runs
    and until the caller's backward is done: released on exit, or, with ``keep``, left for the caller to
    release (``Saved.bytes``) when the graph they belong to is gone.

    Tensors already counted elsewhere (the loaded variables, the layer input) are excluded by storage.
    """
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    saved = Saved()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and t.device.type != "meta":
            seen.add(ptr)
            size = t.untyped_storage().nbytes()
            saved.bytes += size
            store.hold(size)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        if not keep:
            store.free(saved.bytes)
