"""LoRA (Hu et al., 2021) for ipuft, as a plugin: ``model.adapter=lora``, its options ``plugins.lora``.

Each targeted projection ``y = W x`` of the decoder becomes ``y = W x + (alpha / rank) · B A dropout(x)``, with
``A`` ``[rank, in]`` and ``B`` ``[out, rank]``, as peft's ``LoraConfig`` computes it. Every base weight of the
model is frozen (the decoder's, the embeddings' and the head's: no gradient, no optimizer state, no update
traffic); the adapters are the only trainable variables. They are ``added``: a run from a Hugging Face
checkpoint (``model.hf_checkpoint``) loads the base and starts each ``A`` as peft does (Kaiming-uniform, on
``±1/√in``) and each ``B`` from zeros, so that the first step computes the base model.

``plugins.lora.targets`` names projections the way every family shares: ``q``, ``k``, ``v``, ``o`` (attention)
and ``gate``, ``up``, ``down`` (MLP); each decoder declares which of its modules they are (its ``projections``,
see :mod:`ipuft.components`: GPT-J has no ``gate``; its ``up`` and ``down`` are ``fc_in`` and ``fc_out``), so a
new family needs no edit here.

``ipuft export --hf`` merges the adapters into the base (``W + (alpha / rank) · B A``) and writes a plain model;
``ipuft export --adapter`` writes them in peft's format, for ``peft.PeftModel.from_pretrained(base, OUT)``.

Under tensor parallelism an adapter splits as its projection does: a column-parallel ``W`` (q, k, v, gate,
up) has ``B`` sharded by rows like it and ``A`` whole on every rank, its gradient summed over TP; a
row-parallel one (o, down) has ``A`` sharded by columns like it and ``B`` whole, its gradient summed over TP.

This module holds the hooks only and imports no torch; the adapters are :mod:`ipuft_lora.module`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import HasProjections
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

NAME = "lora"
SECTION = "lora"
NAMES = ("q", "k", "v", "o", "gate", "up", "down")
# Row-parallel projections (their input split over TP); the others are column-parallel.
ROW_PARALLEL = ("o", "down")


@dataclass
class LoRAOptions:
    """``plugins.lora``: used when ``model.adapter=lora``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Projections to adapt, among q, k, v, o, gate, up, down (peft's default for Llama: q and v).
    targets: list[str] = field(default_factory=lambda: ["q", "v"])


def options(cfg: DictConfig) -> LoRAOptions:
    """``plugins.lora``, checked: one line naming the key on a bad value."""
    o = cfg.plugins[SECTION]
    if not 0 < o.rank <= 4096:
        raise ConfigError(f"plugins.lora.rank: must be in [1, 4096], got {o.rank}")
    if not 0.0 < o.alpha < float("inf"):
        raise ConfigError(f"plugins.lora.alpha: must be a finite number > 0, got {o.alpha}")
    if not 0.0 <= o.dropout < 1.0:
        raise ConfigError(f"plugins.lora.dropout: must be in [0, 1), got {o.dropout}")
    unknown = [t for t in o.targets if t not in NAMES]
    if unknown or not o.targets or len(set(o.targets)) != len(o.targets):
        raise ConfigError(f"plugins.lora.targets: {list(o.targets)} must be distinct names among {', '.join(NAMES)}")
    return LoRAOptions(o.rank, o.alpha, o.dropout, list(o.targets))


def target_modules(cfg: DictConfig, decoder: str, module: nn.Module) -> dict[str, str]:
    """Each target's module path in decoder ``decoder`` (``module``), from the projections it declares; one line
    for a decoder that declares none or a target the family lacks."""
    o = options(cfg)
    modules = module.projections if isinstance(module, HasProjections) else None
    if not isinstance(modules, dict) or not modules:
        raise ConfigError(f"model.adapter=lora adapts a decoder's projections, which model.decoder={decoder} does "
                          f"not declare (its module has no projections; set model.adapter=null to train every "
                          f"weight)")
    if lacking := [t for t in o.targets if t not in modules]:
        raise ConfigError(f"plugins.lora.targets: the {decoder} decoder has no {', '.join(lacking)} projection; "
                          f"choose among {', '.join(modules)}")
    return {t: modules[t] for t in o.targets}


@hookimpl
def ipuft_adapt_component(adapter: str, role: str, name: str, module: nn.Module,
                          cfg: DictConfig) -> nn.Module | None:
    """``model.adapter=lora``: the decoder with adapters on its targets, the embeddings and head frozen."""
    if adapter != NAME:
        return None
    from ipuft_lora.module import add_adapters, freeze

    if role != "decoder":
        return freeze(module)
    o = options(cfg)
    return add_adapters(module, target_modules(cfg, name, module), o, cfg.execution.tensor_parallel)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, LoRAOptions, used_when={"model.adapter": NAME}, model_keys=("rank", "alpha", "targets"))
