"""``adamw8bit``: AdamW whose moments are stored block-wise in 8 bits (Dettmers et al. 2022). The update rule
is in :mod:`ipuft_optim_adamw8bit.adamw8bit`, the quantization in :mod:`ipuft_optim_adamw8bit.quantize`; this
module holds the hooks only and imports no torch, so that discovering the plugin stays fast. Its
hyperparameters are its own section, ``plugins.adamw8bit``: ``adamw``'s, and the block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.optim import OptimizerRegistry
from ipuft_optim_adam import AdamOptions, check

if TYPE_CHECKING:
    from ipuft_optim_adamw8bit.adamw8bit import AdamW8bit

NAME = SECTION = "adamw8bit"
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # powers of two: they divide the engine's update pieces


@dataclass
class AdamW8bitOptions(AdamOptions):
    """``plugins.adamw8bit``: ``adamw``'s hyperparameters, and the elements per quantization block (one float32
    absmax each): 256 keeps an outlier's loss of resolution to 256 neighbours for 1/32 byte per parameter."""

    block_size: int = 256


def build(cfg: DictConfig) -> AdamW8bit:
    from ipuft_optim_adamw8bit.adamw8bit import AdamW8bit

    o = cfg.plugins[SECTION]
    check(o, SECTION)
    if o.block_size not in BLOCK_SIZES:
        raise ConfigError(f"plugins.adamw8bit.block_size: must be one of {', '.join(map(str, BLOCK_SIZES))}, "
                          f"got {o.block_size}")
    return AdamW8bit(o.beta1, o.beta2, o.eps, o.weight_decay, o.block_size)


@hookimpl
def ipuft_register_optimizers(registry: OptimizerRegistry) -> None:
    registry.add(NAME, build, "AdamW with block-wise 8-bit moments (2 + 8/block_size bytes of state a parameter)",
                 elementwise=True)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, AdamW8bitOptions, used_when={"training.optimizer.name": NAME})
