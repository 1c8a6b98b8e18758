"""Text generation: the key/value cache, token choice, and batched decoding through the layer-major runner.

Decoding runs a batch of prompts together (:func:`generate`): the prompts are left-padded to one length
and prefilled in one pass, then every step decodes one token for every row that has not finished. Each
pass goes unit by unit through :class:`ipuft.engine.inference.LayerMajor`, so a unit's weights come to the
device once per step for the whole batch, not once per row.

A decoder that supports caching takes ``forward(hidden, cache=LayerKVCache)``: it rotates the new tokens
from their positions (:meth:`LayerKVCache.positions`), appends their keys and values, and attends over all
of them under :meth:`LayerKVCache.attention_mask` when the rows are padded.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ipuft.engine.store import host_copy

if TYPE_CHECKING:
    from ipuft.engine.inference import LayerMajor


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

    def to(self, device: torch.device, pin: bool = False) -> None:
        """Move the cached keys and values to ``device`` (host memory pinned with ``pin``)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == device:
                return t
            if device.type == "cpu":
                return host_copy(t, pin)
            return t.to(device, non_blocking=pin)

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


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """Choose the next token from one position's logits ``[V]``.

    Temperature 0 is greedy (argmax). Otherwise sample from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens (0: all) and then to the nucleus: the smallest set of the most likely
    tokens whose probability sums to at least ``top_p`` (the most likely token is always kept).
    """
    if temperature == 0.0:
        return int(logits.argmax())
    if not (0.0 < temperature < math.inf):
        raise ValueError(f"temperature must be 0 (greedy) or finite and > 0, not {temperature}")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        probs, order = logits.softmax(-1).sort(descending=True)
        before = probs.cumsum(-1) - probs  # probability of the more likely tokens
        drop = before >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def left_padded(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ids[B, T], pad[B])``: the rows left-padded with ``pad_id`` to the longest one; ``pad`` is ``None``
    when every row has the same length (nothing to mask)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    pad = torch.tensor([width - len(r) for r in rows], dtype=torch.long)
    return ids, (pad if bool(pad.any()) else None)


def generate(
    runner: LayerMajor,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | Collection[int] | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each of ``prompts`` by up to ``max_new_tokens`` tokens, all rows together; return the new
    tokens of each row.

    A row stops after emitting ``eos_id`` (one id, or any of several; included in its result); the batch stops
    when every row has.
    With ``use_cache=False`` every step runs the whole sequences again (slow; the reference for the cache).
    Sampling draws from ``generator`` (on the runner's device) row by row, in order.
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate needs prompts of at least one token each")
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    filler = min(stops) if stops else 0  # what a finished row feeds while the others go on
    ids, pad = left_padded(prompts)
    ids = ids.to(runner.device)
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache = KVCache(runner.layers, pad) if use_cache else None
    step_ids = ids
    try:
        with torch.no_grad():
            while max_new_tokens > 0:
                if not use_cache:
                    cache = KVCache(runner.layers, pad)  # no reuse: every pass starts from an empty cache
                logits = runner.logits(step_ids, cache, last_only=True)[:, -1]
                if not use_cache:
                    runner.release(cache)
                chosen = []
                for row, row_logits in enumerate(logits):
                    token = filler if done[row] else next_token(row_logits, temperature, top_k, top_p, generator)
                    chosen.append(token)
                    if not done[row]:
                        new[row].append(token)
                        done[row] = token in stops or len(new[row]) == max_new_tokens
                if all(done):
                    break
                token_ids = torch.tensor(chosen, dtype=torch.long, device=runner.device).unsqueeze(1)
                ids = torch.cat([ids, token_ids], dim=1)
                # With the cache only the new tokens run; without it, the whole sequences again.
                step_ids = token_ids if use_cache else ids
    finally:
        if use_cache:
            runner.release(cache)
    return new
