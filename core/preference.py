"""Preference losses (``data.format=preference``): DPO, IPO and SimPO over pairs of completions, in the head.

A micro-batch of preference data holds whole pairs: rows ``2i`` and ``2i + 1`` are pair ``i``'s chosen and
rejected completions of one prompt, the prompt out of the loss (:class:`~ipuft.data.batch.Batch`). A row's
log-probability ``logp`` is the sum of its completion tokens' log-probabilities (SimPO: their mean). With
``h`` the pair's margin, ``β`` ``training.preference.beta`` and ``n`` a completion's tokens:

- ``dpo``: ``h = β · ((logp_c - ref_c) - (logp_r - ref_r))``, loss ``-log σ(h)``;
- ``ipo``: ``h = (logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r``, loss ``(h - 1 / (2β))²`` (the log-ratios per
  token, as TRL's DPOTrainer and the IPO authors take them);
- ``simpo``: ``h = β · (logp_c - logp_r) - γ`` of the means (no reference), loss ``-log σ(h)`` (TRL's CPOTrainer);

plus ``sft_weight`` times the chosen completion's mean token cross-entropy. ``ref`` are the starting model's
log-probabilities of the same rows (the reference pass, :mod:`ipuft.run.reference`). A micro-batch's loss is
the mean over its pairs, so that the engine's equal weights of equal micro-batches make the step's loss the mean
over the step's pairs, whatever the micro-batching and the data-parallel layout.

The head computes every token's cross-entropy (its loss by chunks of tokens, :mod:`ipuft.head_loss`, or
whole), and :meth:`Pairs.loss` makes the pairs' loss of them. The chunked head needs the gradient of that loss
with respect to each token's cross-entropy before it makes the logits' gradient, ``w_t · (softmax - onehot)``:
:meth:`Pairs.token_weights` gives it by autograd over this small graph (a sum per row, a loss per pair), so the
coupling of a pair's two rows costs no second pass over the model, only the head's logits made once more.
Rewards (``β`` times the log-ratio; SimPO: times logp) and log-probabilities are recorded as TRL
names them (:data:`METRICS`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ipuft.components import IGNORE_INDEX

# The sums each call records (:meth:`Pairs.loss`), in this order; TRL's metric names of their means.
SUMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected",
        "pairs")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """``training.preference``: the loss's kind, ``beta``, SimPO's ``gamma`` and the SFT term's weight."""

    kind: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5
    sft_weight: float = 0.0

    @classmethod
    def of(cls, cfg) -> PreferenceLoss | None:
        """The run's preference loss, or None where its data is not preference data."""
        if str(getattr(cfg.data.format, "value", cfg.data.format)) != "preference":
            return None
        p = cfg.training.preference
        return cls(str(getattr(p.loss, "value", p.loss)), float(p.beta), float(p.simpo_gamma), float(p.sft_weight))

    @property
    def uses_reference(self) -> bool:
        return self.kind != "simpo"



@dataclass
class Pairs:
    """One micro-batch's pairs, while its head runs: the loss, each row's ``reference`` log-probability (``[R]``,
    sums over the completion; zeros for SimPO or before the reference pass), and what the head's calls record:
    ``sums`` (one float64 tensor of :data:`SUMS` per call) and ``logps`` (each row's summed log-probability)."""

    spec: PreferenceLoss
    reference: torch.Tensor
    sums: list[torch.Tensor] = field(default_factory=list)
    logps: list[torch.Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.reference.numel()

    def loss(self, token_losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the micro-batch's pairs of their loss, from each token's cross-entropy
        ``token_losses[R · T]`` (0 where ``labels[R · T]`` is ``IGNORE_INDEX``), differentiable in them; records
        the call's sums and row log-probabilities."""
        spec, rows = self.spec, self.rows
        if rows % 2 or token_losses.numel() % rows:
            raise ValueError(f"preference data: {token_losses.numel()} tokens in {rows} rows; a micro-batch holds "
                             "whole pairs (an even number of rows of one length)")
        keep = (labels != IGNORE_INDEX).view(rows, -1)
        count = keep.sum(-1).clamp_min(1).to(torch.float32)
        summed = -token_losses.float().view(rows, -1).sum(-1)  # each row's log-probability
        logp = summed / count if spec.kind == "simpo" else summed
        chosen, rejected = logp[0::2], logp[1::2]
        if spec.kind == "simpo":
            reward_c, reward_r = spec.beta * chosen, spec.beta * rejected
            losses = -F.logsigmoid(reward_c - reward_r - spec.gamma)
        else:
            ref = self.reference.to(summed.device, torch.float32)
            ratio_c, ratio_r = chosen - ref[0::2], rejected - ref[1::2]
            reward_c, reward_r = spec.beta * ratio_c, spec.beta * ratio_r
            if spec.kind == "ipo":  # the log-ratios per completion token
                losses = (ratio_c / count[0::2] - ratio_r / count[1::2] - 1 / (2 * spec.beta)) ** 2
            else:
                losses = -F.logsigmoid(reward_c - reward_r)
        if spec.sft_weight:
            losses = losses - spec.sft_weight * summed[0::2] / count[0::2]
        with torch.no_grad():
            self.logps.append(summed.detach())
            self.sums.append(torch.stack([
                losses.sum(), reward_c.sum(), reward_r.sum(), (reward_c > reward_r).sum(), chosen.sum(),
                rejected.sum(), torch.tensor(float(rows // 2), device=losses.device)]).double())
        return losses.mean()

    def token_weights(self, token_losses: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss (:meth:`loss`) of ``token_losses`` and its gradient with respect to each of them (the weight
        of that token's ``softmax - onehot`` in the gradient of the logits), 0 for the tokens not trained."""
        leaf = token_losses.detach().float().requires_grad_()
        with torch.enable_grad():
            value = self.loss(leaf, labels)
            (weights,) = torch.autograd.grad(value, leaf)
        return value.detach(), weights * (labels != IGNORE_INDEX)  # (an untrained token's loss is no token's)


_ACTIVE: contextvars.ContextVar[Pairs | None] = contextvars.ContextVar("ipuft_preference_pairs", default=None)


@contextlib.contextmanager
def preference_pairs(pairs: Pairs | None) -> Iterator[Pairs | None]:
    """A head's loss inside the block is ``pairs``' (None: the mean token cross-entropy, as outside)."""
    token = _ACTIVE.set(pairs)
    try:
        yield pairs
    finally:
        _ACTIVE.reset(token)


def active_pairs() -> Pairs | None:
    """The pairs whose loss a head computes now, or None."""
    return _ACTIVE.get()


def summed(records: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The :data:`SUMS` of ``records`` added (zeros for none), float64."""
    total = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    for r in records:
        total += r.to(total.device)
    return total


def metrics(total: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's preference metrics (:data:`METRICS`) from summed :data:`SUMS` (means over the pairs)."""
    values = dict(zip(SUMS, total.tolist()))
    n = max(values["pairs"], 1.0)
    out = {name: values[name] / n for name in SUMS if name not in ("loss", "pairs")}
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return {f"{prefix}{name}": out[name] for name in METRICS}
