"""Learning-rate schedules. The reference's: a linear warm-up from 1e-7 to the maximum over
``int(steps × warmup_proportion)`` steps, then constant. ``linear`` and ``cosine`` decay to zero over
the steps after the warm-up instead."""

from __future__ import annotations

import math

from omegaconf import DictConfig

WARMUP_START = 1e-7


def learning_rate(step: int, total_steps: int, lr_cfg: DictConfig) -> float:
    """The learning rate of optimizer step ``step`` (counted from 0) of ``total_steps``."""
    maximum = lr_cfg.maximum
    warmup = int(total_steps * lr_cfg.warmup_proportion)
    if step < warmup:  # np.linspace(1e-7, maximum, warmup)[step], as the reference builds it
        return WARMUP_START if warmup == 1 else WARMUP_START + (maximum - WARMUP_START) * step / (warmup - 1)
    schedule = lr_cfg.schedule.value
    if schedule == "constant":
        return maximum
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule == "linear":
        return maximum * (1.0 - progress)
    return maximum * 0.5 * (1.0 + math.cos(math.pi * progress))
