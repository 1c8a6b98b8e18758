"""The key/value cache a decoder layer reads and appends while text is generated (the loop that runs it is
:mod:`ipuft.engine.generation`).

A decoder that supports caching takes ``forward(hidden, cache=LayerKVCache)``: it rotates the new tokens
from their positions (:meth:`LayerKVCache.positions`), appends their keys and values, and attends over all
of them under :meth:`LayerKVCache.attention_mask` when the rows are padded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LayerKVCache:
    """One layer's keys and values so far, ``[B, heads, T_kept, head_dim]`` (``None`` while empty).

    ``pad[B]``: how many pad tokens each row starts with (left padding), or ``None`` when no row is padded.
    A row's first real token is its position 0, and no query attends to a pad key.

    A layer that attends within a window of ``W`` positions (``append(..., window=W)``) keeps only its last
    ``W`` keys and values: the next query sees itself and the ``W - 1`` before it. ``start`` is then the index
    (pads included) of the first key kept, and ``length`` still counts every position so far.
    """

    def __init__(self, pad: torch.Tensor | None = None) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pad = pad
        self.start = 0  # the index of the first key kept: past a window, the older ones are dropped
        self.window: int | None = None  # the window of the layer's last append (None: it keeps every key)

    @property
    def kept(self) -> int:
        """How many positions' keys and values are held."""
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def length(self) -> int:
        """How many positions are cached or were, pads included: the index of the next token."""
        return self.start + self.kept

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def positions(self, new: int, device: torch.device) -> torch.Tensor:
        """``[B, new]``: the rotary positions of the next ``new`` tokens of each row (pads get 0)."""
        index = torch.arange(self.length, self.length + new, device=device)
        if self.pad is None:
            return index.unsqueeze(0)
        return (index.unsqueeze(0) - self.pad.to(device).unsqueeze(1)).clamp_(min=0)

    def seen(self, window: int | None = None) -> int:
        """How many of the kept keys the next queries may see: every one, or within ``window`` the last
        ``window - 1`` (the next query's window holds it too)."""
        return self.kept if window is None else min(self.kept, window - 1)

    def masks(self, new: int, window: int | None = None) -> bool:
        """Whether the next ``new`` queries need :meth:`attention_mask`: padded rows, or a window that the
        causal mask over the keys they see does not already keep."""
        return self.pad is not None or (window is not None and self.seen(window) + new > window)

    def attention_mask(self, new: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """``[B, 1, new, seen + new]``: which of the keys :meth:`append` returns (the ``seen`` kept ones, then
        the new) each of the next ``new`` queries may see: causal, within ``window`` when given, and never a
        pad key. A pad query sees itself, so that no softmax row is empty."""
        total = self.length + new
        query = torch.arange(self.length, total, device=device).unsqueeze(1)
        key = torch.arange(self.length - self.seen(window), total, device=device).unsqueeze(0)
        visible = key <= query
        if window is not None:
            visible &= key > query - window
        if self.pad is None:
            return visible[None, None]
        real = key.unsqueeze(0) >= self.pad.to(device).view(-1, 1, 1)  # [B, 1, keys]
        return (visible & (real | (key == query))).unsqueeze(1)

    def append(self, keys: torch.Tensor, values: torch.Tensor,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; return those the new queries may see (every key so far,
        or within ``window`` the last ``window - 1`` kept and the new: :meth:`seen`). Within a window only the
        last ``window`` positions stay kept."""
        seen, total = self.seen(window), self.length + keys.shape[-2]
        if self.keys is not None:
            # A view of the kept keys the queries see; the concatenation is a new tensor of its own.
            keys = torch.cat([self.keys[..., self.kept - seen :, :], keys], dim=-2)
            values = torch.cat([self.values[..., self.kept - seen :, :], values], dim=-2)
        self.keys, self.values, self.window = keys, values, window
        if window is not None and keys.shape[-2] > window:  # a prompt longer than the window: its last W only
            self.keys, self.values = keys[..., -window:, :].clone(), values[..., -window:, :].clone()
        self.start = total - self.kept
        return keys, values

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Keep ``move`` of the cached keys and values instead (the inference engine moves them between the host
        and the device, :class:`ipuft.engine.inference.LayerMajor`)."""
        if self.keys is not None:
            self.keys, self.values = move(self.keys), move(self.values)


class KVCache:
    """One :class:`LayerKVCache` per decoder layer, sharing the rows' padding."""

    def __init__(self, layers: int, pad: torch.Tensor | None = None) -> None:
        self.layers = [LayerKVCache(pad) for _ in range(layers)]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


