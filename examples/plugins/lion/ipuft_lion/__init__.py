"""``lion``: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as an
ipuft plugin. Select it with ``training.optimizer.name=lion``; its hyperparameters are its own section,
``plugins.lion``, which is an error to set while another optimizer is selected.

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the update rule is in :mod:`ipuft_lion.lion`, imported when a run builds the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.optim import OptimizerRegistry

if TYPE_CHECKING:
    from ipuft_lion.lion import Lion

NAME = SECTION = "lion"


@dataclass
class LionOptions:
    """``plugins.lion``: Lion's hyperparameters (used when ``training.optimizer.name=lion``).

    The paper's defaults. Lion's update has unit size per element, so it wants a learning rate 3-10x smaller
    than Adam's, and a weight decay that much larger for the same effect.
    """

    beta1: float = 0.9  # interpolation of momentum and gradient whose sign is the update
    beta2: float = 0.99  # the momentum's decay
    weight_decay: float = 0.0  # decoupled; never on names containing "norm" or "bias" (as adamw)


def options(cfg: DictConfig) -> LionOptions:
    """``plugins.lion`` checked: each beta in [0, 1), the weight decay finite and >= 0 (one error line each)."""
    o = cfg.plugins[SECTION]
    for beta in ("beta1", "beta2"):
        if not 0.0 <= o[beta] < 1.0:
            raise ConfigError(f"plugins.{SECTION}.{beta}: must be in [0, 1), got {o[beta]}")
    if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0.0):
        raise ConfigError(f"plugins.{SECTION}.weight_decay: must be a finite number >= 0, got {o.weight_decay}")
    return LionOptions(o.beta1, o.beta2, o.weight_decay)


def build(cfg: DictConfig) -> Lion:
    from ipuft_lion.lion import Lion

    o = options(cfg)
    return Lion(o.beta1, o.beta2, o.weight_decay)


@hookimpl
def ipuft_register_optimizers(registry: OptimizerRegistry) -> None:
    # Each element's update reads only that element's gradient and momentum: any slice of a variable (an RTS
    # shard, a TP shard) updates as the whole would.
    registry.add(NAME, build, "Lion: the sign of an interpolated momentum, one float32 state (Chen et al. 2023)",
                 elementwise=True)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, LionOptions, used_when={"training.optimizer.name": NAME})
