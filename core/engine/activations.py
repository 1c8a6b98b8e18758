"""The batch-serialisation buffers ``x[L+1][GA]`` and ``dx[L+1][GA]``, and working-set accounting.

Row ``n`` of ``x`` holds the input of decoder layer ``n`` for each micro-batch (row ``L`` is the head's
input); ``dx`` holds the gradients flowing back through the same boundaries. Only these layer inputs
survive between phases; everything else is recomputed. The buffers sit on the compute device, or in
host memory with ``execution.activation_offload=true``, in the compute dtype. Under tensor parallelism
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

import torch

from ipuft.engine.profiling import section
from ipuft.engine.store import VariableStore, host_copy
from ipuft.parallel import Layout, all_gather_flat

KINDS = ("x", "dx")


class ActivationBuffers:
    """``x`` and ``dx`` rows of ``GA`` micro-batches each, on the device or offloaded to the host."""

    def __init__(self, store: VariableStore, offload: bool, layout: Layout | None = None) -> None:
        self.store = store
        self.offload = offload
        self.layout = layout or Layout()
        # Pinned host buffers make the copies asynchronous on CUDA, whether or not variables are offloaded.
        self.pin = offload and store.compute.type == "cuda"
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
            with section("copies"):
                tensor = host_copy(tensor, self.pin)
            self.store.traffic.d2h["activation"] += size
        else:
            self.store.ledger.acquire(size)
        self._slots[(kind, row, mb)] = tensor.detach()
        self.live += size
        self.peak = max(self.peak, self.live)

    @contextmanager
    def read(self, kind: str, row: int, mb: int, consume: bool = False) -> Iterator[torch.Tensor]:
        """``kind[row][mb]`` on the compute device for the duration of the block; ``consume`` frees it."""
        key = (kind, row, mb)
        stored = self._slots.pop(key) if consume else self._slots[key]
        shape = self._shapes.pop(key) if consume else self._shapes[key]
        size = stored.numel() * stored.element_size()
        if self.offload:
            with section("copies"):
                tensor = stored.to(self.store.compute, non_blocking=self.pin, copy=True)
            self.store.traffic.h2d["activation"] += size
            self.store.ledger.acquire(size)
        else:
            tensor = stored
        gathered = 0
        if self.layout.tensor_parallel > 1:
            full = tensor.new_empty(size * self.layout.tensor_parallel // tensor.element_size())
            with section("collectives"):
                all_gather_flat(full, tensor, group=self.layout.tp_group)
            tensor, gathered = full.view(shape), size * self.layout.tensor_parallel
            self.store.ledger.acquire(gathered)
        try:
            yield tensor
        finally:
            self.store.ledger.release(gathered)
            if self.offload or consume:
                self.store.ledger.release(size)
            if consume:
                self.live -= size

    def clear(self) -> None:
        """Drop every buffered activation (the end of a step)."""
        if not self.offload:
            self.store.ledger.release(sum(t.numel() * t.element_size() for t in self._slots.values()))
        self._slots.clear()
        self._shapes.clear()
        self.live = self.peak = 0

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
            store.ledger.acquire(size)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        if not keep:
            store.ledger.release(saved.bytes)
