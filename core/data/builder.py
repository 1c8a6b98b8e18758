"""Collecting tokenized examples into a dataset's arrays: each example checked as it arrives, fitted to the rows
(``data.truncation``), its loss mask kept, and the examples laid out as the dataset serves them.

Three layouts (:class:`Layout`), as ``data.packing`` and ``data.whole_examples`` ask:

- ``chunks``: every example concatenated and cut into chunks of ``sequence_length + 1`` (the reference's
  group_texts), the remainder that fills no chunk dropped; an example may straddle two rows.
- ``examples``: one example per row, padded.
- ``whole``: examples packed whole into rows of ``sequence_length + 1``, greedily in file order (an example
  that does not fit in the current row starts the next; the rest of a row is padding out of the loss), so
  that none straddles two rows; each row's positions restart at 0 where an example starts.

A loss mask has one byte per token: 1 where the token is a target (its prediction from the token before is in the
loss), 0 where it is prompt; a dataset without one has every token in the loss.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from enum import Enum

import torch

from ipuft.config.schema import Truncation
from ipuft.errors import DataError

# Padding: the id never reaches the loss (its labels are IGNORE_INDEX), and 0 is a valid id for every vocabulary,
# so no tokenizer needs a pad token.
PAD_ID = 0


class Layout(str, Enum):
    chunks = "chunks"
    examples = "examples"
    whole = "whole"


@dataclass
class Arrays:
    """What a dataset is made of: flat int32 ``tokens``, their uint8 ``mask`` (None: every token in the loss),
    example ``offsets`` (int64; None for chunks) and, packed whole, ``rows`` (int64: row ``r`` holds examples
    ``rows[r]`` to ``rows[r + 1]``)."""

    tokens: torch.Tensor
    mask: torch.Tensor | None
    offsets: torch.Tensor | None
    rows: torch.Tensor | None


class Builder:
    """Collects examples into flat buffers, checking each as it arrives: its ids inside the vocabulary, its length
    fitted to the row as ``truncation`` says (unless chunks, where any length is fine), and an example with no
    label dropped (outside chunks: it would only dilute its micro-batch)."""

    def __init__(self, name: str, sequence_length: int, vocab_size: int, layout: Layout, masked: bool,
                 truncation: Truncation, hint: str = "", pad_tail: bool = False) -> None:
        """``masked``: keep the examples' masks (else every token is in the loss); ``hint``: what to say after an
        example too long with ``truncation=error``; ``pad_tail``: in chunks, the tokens that fill no whole chunk
        make a last row, padded and its padding out of the loss (``data.format=tokens``: the user's own ids,
        never dropped), instead of being dropped (the reference's group_texts, for text)."""
        self.name, self.width, self.vocab_size = name, sequence_length + 1, vocab_size
        self.layout, self.masked, self.truncation, self.hint = layout, masked, truncation, hint
        self.pad_tail = pad_tail
        self.tokens = array("i")
        self.mask = array("B")
        self.offsets = array("q", [0])
        self.dropped = self.truncated = self.examples = 0
        self.unlabelled = 0  # examples with no label (one token, or none in the loss): nothing keeps them
        self.lengths: list[int] = []  # the shortest and longest example seen, and the tokens of all
        self.dropped_lengths: list[int] = []  # the shortest and longest example left out by truncation=drop
        self.total = 0

    def add(self, number: int, ids: list[int], mask: list[int] | None = None) -> None:
        """Append example ``ids`` from row ``number``; ``mask``: its loss mask, one 0 or 1 per id (None: all 1)."""
        if not ids:
            return
        self.examples += 1
        self.lengths = _span(self.lengths, len(ids))
        self.total += len(ids)
        top, bottom = max(ids), min(ids)
        if top >= self.vocab_size or bottom < 0:
            bad = top if top >= self.vocab_size else bottom
            raise DataError(f"{self.name} row {number}: token id {bad} is outside the model's vocabulary "
                            f"(model.embedding.vocab_size = {self.vocab_size})")
        if self.layout is not Layout.chunks:
            if len(ids) > self.width:
                if self.truncation is Truncation.error:
                    raise DataError(f"{self.name} row {number}: {len(ids)} tokens, longer than "
                                    f"model.sequence_length + 1 = {self.width}{self.hint}")
                if self.truncation is Truncation.drop:
                    self.dropped += 1
                    self.dropped_lengths = _span(self.dropped_lengths, len(ids))
                    return
                self.truncated += 1
                ids, mask = ids[:self.width], None if mask is None else mask[:self.width]
            if len(ids) < 2 or (self.masked and mask is not None and not any(mask[1:])):
                self.unlabelled += 1
                return  # no position has a label
        self.tokens.extend(ids)
        if self.masked:
            self.mask.extend([1] * len(ids) if mask is None else mask)
        self.offsets.append(len(self.tokens))

    def report(self) -> None:
        """One line on stderr for each kind of example left out or cut to fit the rows: how many, their lengths,
        and the key that would keep them."""
        lines = []
        if self.dropped:
            low, high = self.dropped_lengths
            lines.append(f"{self.dropped} of {self.examples} examples ({_tokens(low, high)}) are longer than "
                         f"model.sequence_length + 1 = {self.width} tokens and were left out (data.truncation=drop); "
                         f"data.truncation=truncate keeps their first tokens")
        if self.truncated:
            lines.append(f"{self.truncated} of {self.examples} examples are longer than model.sequence_length + 1 = "
                         f"{self.width} tokens and were truncated to their first tokens (data.truncation=truncate)")
        if self.unlabelled:
            lines.append(f"{self.unlabelled} of {self.examples} examples have no token to learn (one token, or none "
                         f"in the loss) and were left out; data.packing=true with data.whole_examples=false keeps "
                         f"their tokens as context")
        for line in lines:
            sys.stderr.write(f"ipuft: note: {self.name}: {line}\n")

    def _empty(self) -> str:
        """Why no row came of the examples, and what would make some: for :class:`DataError`."""
        if not self.examples:
            return f"{self.name}: the dataset is empty (no row holds a token)"
        low, high = self.lengths
        rows = f"its {self.examples} examples hold {_tokens(low, high)} ({self.total} in all)"
        if self.layout is Layout.chunks:
            return (f"{self.name}: the dataset is empty: {rows}, too few to fill one chunk of model.sequence_length "
                    f"+ 1 = {self.width} tokens (data.packing=true concatenates and cuts them); set "
                    f"model.sequence_length to at most {max(self.total - 1, 1)}, or data.packing=false to pad each "
                    f"example (its padding out of the loss)")
        return (f"{self.name}: the dataset is empty: {rows}, and every one was left out (see the notes above: "
                f"{self.dropped} longer than model.sequence_length + 1 = {self.width}, {self.unlabelled} with no "
                f"token to learn)")

    def build(self) -> Arrays:
        """The collected examples in the builder's layout."""
        tokens = _tensor(self.tokens, torch.int32)
        mask = _tensor(self.mask, torch.uint8) if self.masked else None
        if self.layout is Layout.chunks:
            left = len(tokens) % self.width
            if self.pad_tail and left >= 2:  # a last row of the remaining tokens, its padding out of the loss
                real = torch.ones(len(tokens), dtype=torch.uint8) if mask is None else mask
                pad = self.width - left
                tokens = torch.cat([tokens, torch.full((pad,), PAD_ID, dtype=torch.int32)])
                mask = torch.cat([real, torch.zeros(pad, dtype=torch.uint8)])
            whole = len(tokens) // self.width * self.width  # the reference's group_texts drops the remainder
            if not whole:
                raise DataError(self._empty())
            return Arrays(tokens[:whole].clone(), None if mask is None else mask[:whole].clone(), None, None)
        if len(self.offsets) < 2:
            raise DataError(self._empty())
        offsets = torch.tensor(self.offsets, dtype=torch.long)
        rows = fill_rows(offsets, self.width) if self.layout is Layout.whole else None
        return Arrays(tokens.clone(), None if mask is None else mask.clone(), offsets, rows)


def _span(span: list[int], length: int) -> list[int]:
    """``[shortest, longest]`` with ``length`` seen too."""
    return [min(span[0], length), max(span[1], length)] if span else [length, length]


def _tokens(low: int, high: int) -> str:
    return f"{low} tokens" if low == high else f"{low} to {high} tokens"


def _tensor(buffer: array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=dtype) if len(buffer) else torch.empty(0, dtype=dtype)


def fill_rows(offsets: torch.Tensor, width: int) -> torch.Tensor:
    """Rows for the examples of ``offsets`` (each at most ``width`` tokens), filled greedily in order: an example
    goes in the current row if it fits, else it starts a new one. ``rows[r]``: row ``r``'s first example."""
    rows = [0]
    used = 0
    for index, length in enumerate((offsets[1:] - offsets[:-1]).tolist()):
        if used + length > width:
            rows.append(index)
            used = 0
        used += length
    if len(offsets) > 1:
        rows.append(len(offsets) - 1)
    return torch.tensor(rows, dtype=torch.long)
