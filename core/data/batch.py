"""One optimizer step's data: what the data sources produce and the engine consumes (a module of its own,
so that the data modules need not import the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One optimizer step's data for this replica: ``[GA, micro_batch_size, sequence_length]`` each."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def micro_batches(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()
