"""What one optimizer step's phases share (:class:`StepState`), apart from the compute that reads and writes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ipuft.data.batch import Batch
from ipuft.preference import Pairs, PreferenceLoss, preference_pairs


@dataclass
class StepState:
    """What one optimizer step's phases share: its batch (on the compute device), learning rate, loss scale and
    update number, the micro-batches' losses, the squared global gradient norm as it is summed, each
    micro-batch's positions (:func:`ipuft.engine.phased.micro_batch_positions`), and each micro-batch's weight
    in the step's loss (``n_mb · DP / n``, :func:`ipuft.engine.phased.token_weights`)."""

    batch: Batch
    lr: float
    loss_scale: float
    update: int
    norm_sq: torch.Tensor
    positions: list[torch.Tensor | None] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    grad_norm: float = float("nan")
    skip: bool = False
    preference: PreferenceLoss | None = None  # preference data: its loss, and each head call's sums
    pair_sums: list[list[torch.Tensor]] = field(default_factory=list)

    def weight(self, mb: int) -> float:
        """Micro-batch ``mb``'s weight in the step's loss (``1 / GA`` where no weights were given)."""
        return self.weights[mb] if self.weights else 1.0 / self.batch.micro_batches

    def pairs(self, mb: int):
        """Preference data: micro-batch ``mb``'s pairs, whose loss its head computes inside the block."""
        return preference_pairs(Pairs(self.preference, self.batch.reference[mb]))
