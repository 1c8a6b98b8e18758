"""The order in which a dataset's rows (or a preference dataset's pairs) are served (:class:`Sampler`)."""

from __future__ import annotations

from functools import lru_cache

import torch

from ipuft.errors import DataError


class Sampler:
    """The order in which rows are served: epochs concatenated into one endless stream of row indices.

    Sample ``k`` of the stream is row ``order(k // size)[k % size]``, where an epoch's order is a
    permutation drawn from ``seed + epoch`` when shuffling, and file order otherwise. Nothing else is
    needed to find any sample, so the position of a run is just the number of samples it has consumed.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.samples_seen = 0
        # A global batch touches at most two epochs; a few cached permutations make consecutive steps cheap.
        self._order = lru_cache(maxsize=4)(self._epoch_order)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Row indices of samples ``start, ..., start + count - 1`` of the stream."""
        parts, k, end = [], start, start + count
        while k < end:
            epoch, offset = divmod(k, self.size)
            take = min(self.size - offset, end - k)
            parts.append(self._order(epoch)[offset:offset + take])
            k += take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def state_dict(self) -> dict[str, int]:
        """The sampler's position: ``{"seed", "shuffle", "rows", "samples_seen"}``."""
        return {"seed": self.seed, "shuffle": int(self.shuffle), "rows": self.size,
                "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`; the dataset must have the same number of rows."""
        if int(state["rows"]) != self.size:
            raise DataError(f"data: the saved data position is for a dataset of {state['rows']} rows; "
                            f"this one has {self.size}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.samples_seen = int(state["samples_seen"])
        self._order.cache_clear()
