"""``adamw``: the reference's AdamOptimizerStep (popxl-addons). The update rule is in
:mod:`ipuft_optim_adam.adamw`; this module holds the hooks only and imports no torch, so that discovering
the plugin (``ipuft --help``) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.optim import OptimizerRegistry

if TYPE_CHECKING:
    from ipuft_optim_adam.adamw import AdamW


def build(cfg: DictConfig) -> AdamW:
    from ipuft_optim_adam.adamw import AdamW

    o = cfg.training.optimizer
    return AdamW(o.beta1, o.beta2, o.eps, o.weight_decay, o.gradient_clipping)


@hookimpl
def ipuft_register_optimizers(registry: OptimizerRegistry) -> None:
    registry.add("adamw", build, "Adam with decoupled weight decay, global-norm clipping, loss-scale removal")
