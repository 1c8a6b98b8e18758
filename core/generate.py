"""Text generation from the three components, with a key/value cache.

The modules are the engine's own (possibly on the meta device): they are always run with the per-unit
weights (``embeddings``, ``decoder.{n}``, ``head``) bound in place of their parameters
(:func:`ipuft.components.bound`), as in training. A decoder that supports caching takes
``forward(hidden, cache=LayerKVCache)``: it rotates the new tokens from position ``cache.length``, appends
their keys and values and attends over all of them.

Decoding is one sequence at a time: the prompt is run once (prefill), then one token per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ipuft.components import bound


class LayerKVCache:
    """One layer's keys and values so far, ``[B, heads, T_past, head_dim]`` (``None`` while empty)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """How many positions are cached: the position of the next token."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values; return every key and value so far."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values


class KVCache:
    """One :class:`LayerKVCache` per decoder layer."""

    def __init__(self, layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(layers)]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


@contextmanager
def evaluating(modules: Mapping[str, nn.Module]) -> Iterator[None]:
    """Dropout off: every (sub)module's ``training`` flag is False inside, and restored afterwards.

    The modules are shared with the training engine, so their flags are put back as they were.
    """
    flags = [(m, m.training) for module in modules.values() for m in module.modules()]
    try:
        for m, _ in flags:
            m.training = False
        yield
    finally:
        for m, training in flags:
            m.training = training


def forward_logits(
    modules: Mapping[str, nn.Module],
    weights: Mapping[str, Mapping[str, torch.Tensor]],
    layers: int,
    input_ids: torch.Tensor,
    cache: KVCache | None = None,
    last_only: bool = False,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``input_ids[B, T]`` (``[B, 1, V]``, the last position's, if ``last_only``).

    With a ``cache`` the ids continue the cached positions, and the cache is extended by them.
    """
    with bound(modules["embeddings"], weights["embeddings"]) as embeddings:
        hidden = embeddings(input_ids)
    for n in range(layers):
        kwargs = {} if cache is None else {"cache": cache[n]}
        with bound(modules["decoder"], weights[f"decoder.{n}"]) as decoder:
            hidden = decoder(hidden, **kwargs)
    if last_only:
        hidden = hidden[:, -1:]
    with bound(modules["head"], weights["head"]) as head:
        return head(hidden)


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
    if temperature < 0.0:
        raise ValueError(f"temperature must be ≥ 0, not {temperature}")
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


def generate(
    modules: dict[str, nn.Module],
    weights: dict[str, dict[str, torch.Tensor]],
    layers: int,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens; return the new tokens only.

    Stops after emitting ``eos_id`` (included in the result). With ``use_cache=False`` every step runs the
    whole sequence again (slow; the reference for the cache). ``generator`` drives the sampling, and must
    be on the logits' device.
    """
    if not prompt_ids:
        raise ValueError("generate needs a prompt of at least one token")
    device = next(iter(weights["embeddings"].values())).device
    step_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    cache = KVCache(layers) if use_cache else None
    new: list[int] = []
    with torch.no_grad(), evaluating(modules):
        while len(new) < max_new_tokens:
            logits = forward_logits(modules, weights, layers, step_ids, cache, last_only=True)[0, -1]
            token = next_token(logits, temperature, top_k, top_p, generator)
            new.append(token)
            if token == eos_id:
                break
            token_ids = torch.tensor([[token]], dtype=torch.long, device=device)
            # With the cache only the new token runs; without it, the whole sequence again.
            step_ids = token_ids if use_cache else torch.cat([step_ids, token_ids], dim=1)
    return new
