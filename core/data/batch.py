"""One optimizer step's data: what the data sources produce and the engine consumes (a module of its own,
so that the data modules need not import the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One optimizer step's data for this replica: ``[GA, micro_batch_size, sequence_length]`` each.

    ``positions``: each token's position within its example, ``[GA, micro_batch_size, sequence_length]`` int64,
    restarting at 0 where a packed example starts; None: one example per row (positions 0, 1, ...).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None

    @property
    def micro_batches(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()
