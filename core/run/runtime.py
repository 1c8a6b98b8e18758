"""From a resolved, validated config to a ready engine: what ``train``, ``eval``, ``generate``, ``bench`` and
the tests share.

The config arrives resolved and validated (:func:`ipuft.config.load_config`, or a checkpoint's through
:func:`ipuft.config.load.checkpoint_config`); nothing here changes it. It picks the device, joins the
process layout, builds the components and, for training, the optimizer, and fills the variable store
from ``checkpoint.load``, ``model.init_checkpoint``, ``model.hf_checkpoint`` or the seeded random init.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from ipuft.engine.model import ModelParts, build_model
from ipuft.engine.phased import PhasedEngine
from ipuft.engine.stored import StoredModel
from ipuft.engine.variables import Initializer, initial_values
from ipuft.errors import ConfigError
from ipuft.io.checkpoint import checkpoint_initializer, find_checkpoint
from ipuft.io.hf_import import hf_initializer
from ipuft.kernels import require_precision_support
from ipuft.optim import Optimizer
from ipuft.parallel import init_layout
from ipuft.plugins import PluginHooks


def select_device(cfg: DictConfig) -> torch.device:
    """``execution.device``: ``auto`` takes CUDA when available; under torchrun, the local rank's GPU. A GPU
    that cannot compute in ``model.precision`` is refused (:func:`ipuft.kernels.require_precision_support`)."""
    choice = cfg.execution.device.value
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("execution.device: cuda was asked for but no CUDA device is available; use auto or cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device(choice)
    require_precision_support(cfg, device)
    return device


def initializer(cfg: DictConfig, parts: ModelParts) -> Initializer:
    """Initial weights from ``checkpoint.load``, ``model.init_checkpoint`` or ``model.hf_checkpoint``, else
    random (seeded by ``model.seed``)."""
    for source in (cfg.checkpoint.load, cfg.model.init_checkpoint):
        if source is not None:
            return checkpoint_initializer(find_checkpoint(source), units=parts.program.units())

    def random(unit: str, specs: list) -> dict:
        return initial_values(unit, specs, cfg.model.seed)

    if cfg.model.hf_checkpoint is not None:  # variables it has no name for (added: an adapter's) start random
        return hf_initializer(cfg.model.hf_checkpoint, parts.modules, cfg.model.layers, random)
    return random


def build_engine(cfg: DictConfig, hooks: PluginHooks, parts: ModelParts | None = None,
                 optimizer: Optimizer | None = None) -> PhasedEngine:
    """Join the process layout, then build the optimizer and the components (unless given: ``parts`` built with
    that ``optimizer``, as :func:`ipuft.run.train.train` does) and the engine."""
    device = select_device(cfg)
    layout = init_layout(cfg, device)
    if optimizer is None:
        optimizer = hooks.registrations.build_optimizer(cfg)
    parts = parts or build_model(cfg, hooks, optimizer)
    torch.manual_seed(cfg.model.seed)
    return PhasedEngine(cfg, parts, optimizer, device, layout, initializer(cfg, parts))


def inference_engine(cfg: DictConfig, hooks: PluginHooks) -> StoredModel:
    """The model's weights only in the store (no optimizer state, no gradients), for ``eval`` and ``generate``
    through :class:`ipuft.engine.inference.LayerMajor`."""
    device = select_device(cfg)
    layout = init_layout(cfg, device)
    parts = build_model(cfg, hooks)
    return StoredModel(cfg, parts, device, layout, initializer=initializer(cfg, parts))
