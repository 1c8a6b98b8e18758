"""The built-in sample data: deterministic token sequences with structure a small model learns fast.

A fixed lexicon of short "words" (random token strings, drawn once from ``data.seed``) is sampled into
sentences. Within a word every token is predictable from the previous ones, so the loss falls visibly
from ``ln(vocab)`` towards the entropy of word boundaries. Batch ``k`` depends only on ``(seed, k)``, so
a run's data position is just its step count. It is used when ``data.path`` is null; real datasets
are read by :mod:`ipuft.data.tokens`.
"""

from __future__ import annotations

import torch

from ipuft.data.batch import Batch

LEXICON_WORDS = 48
WORD_LENGTHS = (3, 8)


class SampleData:
    """Rows of ``sequence_length + 1`` tokens; inputs and labels are the row shifted by one."""

    def __init__(self, vocab_size: int, sequence_length: int, seed: int = 0) -> None:
        self.vocab_size, self.sequence_length, self.seed = vocab_size, sequence_length, seed
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(WORD_LENGTHS[0], WORD_LENGTHS[1] + 1, (LEXICON_WORDS,), generator=g)
        self.lexicon = [torch.randint(0, vocab_size, (int(n),), generator=g) for n in lengths]

    def rows(self, step: int, count: int) -> torch.Tensor:
        """``count`` rows of ``sequence_length + 1`` tokens for global batch number ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        width = self.sequence_length + 1
        rows = []
        for _ in range(count):
            words, length = [], 0
            while length < width:
                word = self.lexicon[int(torch.randint(0, LEXICON_WORDS, (1,), generator=g))]
                words.append(word)
                length += len(word)
            rows.append(torch.cat(words)[:width])
        return torch.stack(rows)

    def batch(self, step: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
              replicas: int = 1) -> Batch:
        """Data-parallel ``rank``'s share of global batch ``step``, as ``[GA, mbs, seq]`` tensors.

        The global batch is cut into micro-batches of consecutive rows; rank ``r`` of ``replicas`` takes
        micro-batches ``r, r + replicas, ...``, so the replicas' micro-batches are disjoint and together
        are exactly those of a single process.
        """
        rows = self.rows(step, global_batch_size)
        micro = rows.reshape(-1, micro_batch_size, self.sequence_length + 1)[rank::replicas]
        return Batch(micro[..., :-1].contiguous(), micro[..., 1:].contiguous())
