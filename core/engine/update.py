"""The optimizer step in pieces: how the engine cuts a unit's variables for the optimizer's calls, and what each
call adds on the device (shared with ``ipuft plan``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ipuft.engine.precision import Recipe, rounding_workspace


def update_chunk(device: torch.device | str) -> int:
    """The most elements one optimizer call updates on ``device`` (see :meth:`PhasedEngine._optimizer_step`).

    On the CPU a few hundred thousand: the pieces of weight, gradient, state and temporaries one call touches
    (a few MB) stay in cache between the update's passes, and 16-bit rounding, about thirty int32 passes, runs
    fastest there (4.4 ns a weight at 2^18, 6.2 at 2^20, on the 2-core CI CPU). On a GPU, where each pass is a
    kernel launch, a few million, so that launches stay few."""
    return 1 << 18 if torch.device(device).type == "cpu" else 1 << 22


def update_groups(sizes: list[tuple[str, int]], chunk: int | None) -> Iterator[list[tuple[str, int, int]]]:
    """The groups of pieces ``(variable, start, stop)`` that one optimizer call each updates: the flat elements
    of the variables ``sizes`` (``(name, numel)``, in order) cut into pieces and grouped so that a group holds
    at most ``chunk`` elements; with ``chunk`` ``None``, each variable whole, one per group."""
    if chunk is None:
        yield from ([(name, 0, numel)] for name, numel in sizes if numel)
        return
    group: list[tuple[str, int, int]] = []
    room = chunk
    for name, numel in sizes:
        start = 0
        while start < numel:
            stop = start + min(room, numel - start)
            group.append((name, start, stop))
            room -= stop - start
            start = stop
            if not room:
                yield group
                group, room = [], chunk
    if group:
        yield group


def group_transient_bytes(how: Recipe, pieces: list[int]) -> int:
    """The device bytes one optimizer call over pieces of these sizes adds, besides what the optimizer itself
    makes: for 16-bit weights the float32 gradients, the float32 views (unless a master copy is the view)
    and the stochastic rounding's workspace; nothing for float32 weights, updated in place."""
    if how is Recipe.exact or not pieces:
        return 0
    numel = sum(pieces)
    views = numel * (4 if how is Recipe.master else 8)
    return views + (rounding_workspace(max(pieces)) if how is Recipe.stochastic else 0)
