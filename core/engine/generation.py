"""Text generation's loop: token choice and batched decoding through the layer-major runner.

Decoding runs a batch of prompts together (:func:`generate`): the prompts are left-padded to one length
and prefilled in one pass, then every step decodes one token for every row that has not finished. Each
pass goes unit by unit through :class:`ipuft.engine.inference.LayerMajor`, so a unit's weights come to the
device once per step for the whole batch, not once per row. What a caching decoder layer reads and appends
is :class:`ipuft.generate.LayerKVCache`.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from ipuft.engine.inference import LayerMajor
from ipuft.generate import KVCache


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
