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

    ``reference``: preference data (``data.format=preference``), ``[GA, micro_batch_size]`` float32, each row's
    reference log-probability (the sum over its completion's tokens, :mod:`ipuft.preference`; zeros for a
    reference-free loss or before the reference pass). Rows ``2i`` and ``2i + 1`` of a micro-batch are pair
    ``i``'s chosen and rejected completions. None: not preference data.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    @property
    def micro_batches(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()
