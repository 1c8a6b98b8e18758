"""LoRA (Hu et al., 2021) on ipuft's GPT-J decoder, as a plugin: ``model.decoder=gptj_lora``.

Each targeted projection ``y = W x`` becomes ``y = W x + (alpha / rank) · B A dropout(x)``, with ``A``
``[rank, in]`` and ``B`` ``[out, rank]``. The stock block's variables are frozen (no gradient, no optimizer
state, no update traffic); the adapters are the only trainable ones. They are marked ``added``: a run that
starts from a Hugging Face checkpoint (``model.hf_checkpoint``) loads the base and starts each ``A`` from
its init (normal, std ``1/rank``) and each ``B`` from zeros, so the first step computes the base model.
``ipuft export`` merges the adapters into the base weights (``W + (alpha / rank) · B A``) and writes a plain
GPT-J. Its options are ``plugins.lora``; freeze the embeddings and head too with
``model.freeze=[embeddings,head]``.

This module holds the hooks only and imports no torch; the block is :mod:`ipuft_lora.module`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.sharding import ShardSpec, replicated

NAME = "gptj_lora"
SECTION = "lora"
# Column-parallel projections: their adapters add to the output a rank computes whole.
TARGETS = ("q_proj", "k_proj", "v_proj", "fc_in")


@dataclass
class LoRAOptions:
    """``plugins.lora``: used when ``model.decoder=gptj_lora``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


def options(cfg: DictConfig) -> LoRAOptions:
    """``plugins.lora``, checked: one line naming the key on a bad value."""
    o = cfg.plugins[SECTION]
    if not 0 < o.rank <= 4096:
        raise ConfigError(f"plugins.lora.rank: must be in [1, 4096], got {o.rank}")
    if not 0.0 < o.alpha < float("inf"):
        raise ConfigError(f"plugins.lora.alpha: must be a finite number > 0, got {o.alpha}")
    if not 0.0 <= o.dropout < 1.0:
        raise ConfigError(f"plugins.lora.dropout: must be in [0, 1), got {o.dropout}")
    unknown = [t for t in o.targets if t not in TARGETS]
    if unknown or not o.targets or len(set(o.targets)) != len(o.targets):
        raise ConfigError(f"plugins.lora.targets: {list(o.targets)} must be distinct names among {', '.join(TARGETS)}")
    return LoRAOptions(o.rank, o.alpha, o.dropout, list(o.targets))


def build(cfg: DictConfig):
    from ipuft_lora.module import LoRADecoderBlock

    if cfg.model.family != "gptj":
        raise ConfigError(f"model.decoder: {NAME} adapts GPT-J's block, but the model is a {cfg.model.family} "
                          f"(model.family); LoRA for it is not available: drop model.decoder to fine-tune every "
                          f"weight of its own decoder")
    return LoRADecoderBlock.from_config(cfg, options(cfg))


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec],
                     tensor_parallel: int) -> dict[str, ShardSpec] | None:
    """Every variable whole (the adapters' A would need its gradient summed over TP ranks, which core's
    replicated variables do not do): LoRA runs at tensor_parallel=1, with DP and RTS as usual. An answer by
    the hook, not a mapping with the registration: the variables' names depend on ``plugins.lora.targets``."""
    if (role, name) != ("decoder", NAME):
        return None
    if tensor_parallel > 1:
        raise ConfigError(f"model.decoder: {NAME} runs at execution.tensor_parallel=1 (got {tensor_parallel}); use "
                          f"data parallelism (execution.data_parallel, with execution.rts) instead")
    return replicated(variables)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("decoder", NAME, build, "GPT-J block, frozen, with trainable LoRA adapters (plugins.lora)")


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, LoRAOptions, used_when={"model.decoder": NAME}, model_keys=("rank", "alpha", "targets"))
