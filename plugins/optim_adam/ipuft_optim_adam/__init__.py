"""``adamw``: the reference's AdamOptimizerStep (popxl-addons). The update rule is in
:mod:`ipuft_optim_adam.adamw`; this module holds the hooks only and imports no torch, so that discovering
the plugin (``ipuft --help``) stays fast. Its hyperparameters are its own section, ``plugins.adamw``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.optim import OptimizerRegistry

if TYPE_CHECKING:
    from ipuft_optim_adam.adamw import AdamW

NAME = SECTION = "adamw"


@dataclass
class AdamOptions:
    """``plugins.adamw``: Adam's hyperparameters (used when ``training.optimizer.name=adamw``)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6  # hard-coded 1e-6 in the reference
    weight_decay: float = 0.01  # decoupled; never on names containing "norm" or "bias"


def check(o: DictConfig, section: str) -> None:
    """Refuse Adam hyperparameters ``o`` out of range, one line naming ``plugins.<section>.<key>``."""
    for beta in ("beta1", "beta2"):
        if not 0.0 <= o[beta] < 1.0:
            raise ConfigError(f"plugins.{section}.{beta}: must be in [0, 1), got {o[beta]}")
    if not 0.0 < o.eps < float("inf"):
        raise ConfigError(f"plugins.{section}.eps: must be a finite number > 0, got {o.eps}")
    if not 0.0 <= o.weight_decay < float("inf"):
        raise ConfigError(f"plugins.{section}.weight_decay: must be a finite number >= 0, got {o.weight_decay}")


def build(cfg: DictConfig) -> AdamW:
    from ipuft_optim_adam.adamw import AdamW

    o = cfg.plugins[SECTION]
    check(o, SECTION)
    return AdamW(o.beta1, o.beta2, o.eps, o.weight_decay)


@hookimpl
def ipuft_register_optimizers(registry: OptimizerRegistry) -> None:
    registry.add(NAME, build, "Adam with decoupled weight decay (the reference's AdamOptimizerStep)", elementwise=True)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, AdamOptions, used_when={"training.optimizer.name": NAME})
