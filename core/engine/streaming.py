"""The update streamed: a unit's weights, optimizer state and gradient brought to the device piece by piece.

An update on the device (``execution.optimizer_placement=device``, offloaded variables) would otherwise load
the whole unit first: for Llama-3-8B's head, 1 GiB of bfloat16 weights, 4 GiB of Adam state and 1 GiB of
gradient, the step's largest device holding. Instead, the groups the update alone needs (every group of an
update-only phase; the optimizer state of one that computes the gradient it updates with, the embeddings')
stay in host memory, and each optimizer call's pieces (:func:`ipuft.engine.cuts.update_groups`, at most
``execution.update_piece_bytes`` of them) are copied to the device, updated, and the weights and state copied
back into the host tensors they came from. On CUDA, the next piece's copy runs on the store's side stream
while the current one updates, so the phase holds two pieces at most; on a CPU device the host is the
device's memory, and the pieces are views of the stored tensors, updated in place (the same code path, with
the copies skipped as the store skips them). The optimizer sees exactly the calls, elements and offsets of
an update of the unit loaded whole, so the results are bit for bit the same (stochastic rounding keys on
each element's index in the full variable, not on the piece).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ipuft.engine.cuts import call_chunk, double_buffered, piece_elements, update_groups
from ipuft.engine.store import Tensors, nbytes
from ipuft.optim import StepContext, state_piece
from ipuft.profiling import section
from ipuft.program import Phase


@dataclass
class _Piece:
    """One optimizer call's pieces on the device, their host sources, and the copy that brings them."""

    group: list[tuple[str, int, int]]
    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]
    back: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (group, host, device)
    size: int = 0
    ready: torch.cuda.Event | None = None


class StreamedUpdate:
    """Updates a unit from pieces streamed to the device (see the module docstring)."""

    def __init__(self, update) -> None:
        """``update``: the :class:`~ipuft.engine.update.UnitUpdate` whose calls run the pieces."""
        self.update = update
        self.model = update.model
        self.store = update.store
        self.piece_bytes = int(self.model.cfg.execution.update_piece_bytes)

    def run(self, phase: Phase, streamed: frozenset[str], names: list[str], weights: Tensors | None,
            grads: Tensors | None, ctx: StepContext) -> None:
        """Update ``phase``'s trainable ``names``; ``weights`` and ``grads`` are on the device already where
        their groups are not ``streamed`` (the phase computed with them, or computed them)."""
        stored = self.store.entries[phase.unit]
        sources = {"fwd": stored["fwd"] if "fwd" in streamed else weights,
                   "grad": stored["grad"] if "grad" in streamed else grads}
        states: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        for key, t in stored["optim"].items():
            if key.variable in states:
                states[key.variable][key.state] = t
        sizes = [(n, sources["fwd"][n].numel()) for n in names]
        numel = sum(size for _, size in sizes)
        total = (sum(nbytes(ts.values()) for ts in states.values())
                 + sum(nbytes(sources[g][n] for n in names) for g in ("fwd", "grad") if g in streamed))
        chunk = call_chunk(self.update.optimizer, self.model.device, piece_elements(self.piece_bytes, numel, total))
        groups = list(update_groups(sizes, chunk, self.update.multiple))
        self.store.after_compute()  # earlier phases' stores into host memory land first
        ahead = double_buffered(self.model.device) and not self.store.lends
        pending = self._fetch(groups[0], sources, states, streamed) if groups else None
        for k in range(len(groups)):
            piece = pending
            self._arrived(piece)
            following = groups[k + 1] if k + 1 < len(groups) else None
            pending = self._fetch(following, sources, states, streamed) if ahead and following else None
            self.update.pieces(phase, piece.group, piece.weights, piece.grads, piece.states, ctx)
            self._return(piece)
            if not ahead and following:
                pending = self._fetch(following, sources, states, streamed)

    def _fetch(self, group: list[tuple[str, int, int]], sources: dict[str, Tensors],
               states: dict[str, dict[str, torch.Tensor]], streamed: frozenset[str]) -> _Piece:
        """Bring one call's pieces to the device (on the side stream, on CUDA), counted as loads."""
        piece = _Piece(group, [], [], [])
        store, optimizer = self.store, self.update.optimizer
        with section("copies"), store.beside_compute() as done:
            for name, start, stop in group:
                piece.weights.append(self._bring("fwd", sources["fwd"][name].view(-1)[start:stop], streamed, piece))
                piece.grads.append(self._bring("grad", sources["grad"][name].view(-1)[start:stop], streamed, piece))
                piece.states.append({k: self._bring("optim", state_piece(optimizer, k, t, start, stop), streamed, piece)
                                     for k, t in states[name].items()})
        piece.ready = done[0] if done else None
        store.hold(piece.size)
        return piece

    def _bring(self, group: str, flat: torch.Tensor, streamed: frozenset[str], piece: _Piece) -> torch.Tensor:
        """A piece ``flat`` (a flat view of a stored tensor) on the device: a copy of a streamed group's host
        tensor (the view itself, where the store lends host memory), the view otherwise."""
        if group not in streamed:
            return flat
        piece.size += flat.numel() * flat.element_size()  # held with the call's other pieces (_fetch)
        if self.store.lends:
            out = flat
            self.store.brought(group, flat.numel() * flat.element_size(), held=False)
        else:
            out = self.store.bring(flat, group, held=False)
        if group != "grad":  # updated: goes back
            piece.back.append((group, flat, out))
        return out

    def _arrived(self, piece: _Piece) -> None:
        """The compute stream waits for the piece's copy; its tensors are used there (CUDA)."""
        if piece.ready is None:
            return
        current = torch.cuda.current_stream(self.model.device)
        current.wait_event(piece.ready)
        for t in [*piece.weights, *piece.grads, *(s for states in piece.states for s in states.values())]:
            t.record_stream(current)

    def _return(self, piece: _Piece) -> None:
        """Copy the updated weights and state back into their host tensors, counted as stores."""
        for group, host, device in piece.back:
            self.store.send_into(host, device, group)
        self.store.free(piece.size)
