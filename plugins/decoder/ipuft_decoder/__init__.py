"""The GPT-J decoder block's ipuft hooks, and GPT-J's Hugging Face family (:mod:`ipuft_decoder.family`).

This module imports no torch, so that discovering the plugin (``ipuft --help``) stays fast; the block itself
is in :mod:`ipuft_decoder.block`, imported when a run builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.families import ModelFamilyRegistry
from ipuft.sharding import COLUMN, REPLICATED, ROW
from ipuft_decoder.family import GPTJ

if TYPE_CHECKING:
    from ipuft_decoder.block import GPTJDecoderBlock

NAME = "gptj"
SECTION = "gptj_decoder"

__all__ = ["DecoderOptions"]


class AttentionKernel(str, Enum):
    sdpa = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    eager = "eager"  # explicit matmul-softmax-matmul, as Hugging Face's eager path


@dataclass
class DecoderOptions:
    """``plugins.gptj_decoder``: options of the GPT-J decoder block."""

    attention_kernel: AttentionKernel = AttentionKernel.sdpa


def check(cfg: DictConfig) -> None:
    """GPT-J's head rules, one line each: a head is hidden / heads wide, and rotates its first rotary_dim."""
    m = cfg.model
    heads, rotary = m.attention.heads, m.attention.rotary_dim
    if m.hidden_size % heads:
        raise ConfigError(f"model.hidden_size: {m.hidden_size} is not divisible by model.attention.heads={heads} "
                          f"(a GPT-J head is hidden_size / heads wide)")
    if rotary > m.hidden_size // heads:
        raise ConfigError(f"model.attention.rotary_dim: must be at most the head size {m.hidden_size // heads} "
                          f"(model.hidden_size / model.attention.heads), got {rotary}")


def block_arguments(cfg: DictConfig) -> dict:
    """The block's constructor arguments: the model's sizes and ``tensor_parallel``, of which the block takes
    this rank's share of the heads and of the MLP width (for plugins that build on the block, such as a LoRA
    decoder)."""
    check(cfg)
    m, tp = cfg.model, cfg.execution.tensor_parallel
    return {
        "hidden_size": m.hidden_size,
        "heads": m.attention.heads,
        "head_dim": m.hidden_size // m.attention.heads,
        "intermediate_size": m.intermediate_size,
        "rotary_dim": m.attention.rotary_dim,
        "rotary_base": m.attention.rotary_positional_embeddings_base,
        "layer_norm_epsilon": m.layer_norm_epsilon,
        "dropout_prob": m.dropout_prob,
        "attention_kernel": cfg.plugins[SECTION].attention_kernel.value,
        "tensor_parallel": tp,
    }


def build(cfg: DictConfig) -> GPTJDecoderBlock:
    """One layer with this tensor-parallel rank's share of the heads and of the MLP width."""
    from ipuft_decoder.block import GPTJDecoderBlock

    return GPTJDecoderBlock(**block_arguments(cfg))


SHARD_SPECS = {
    "norm.weight": REPLICATED,
    "norm.bias": REPLICATED,
    # Attention is sharded by heads: q, k, v by output rows, out_proj by input columns.
    "attn.q_proj.weight": COLUMN,
    "attn.k_proj.weight": COLUMN,
    "attn.v_proj.weight": COLUMN,
    "attn.out_proj.weight": ROW,
    "mlp.fc_in.weight": COLUMN,
    "mlp.fc_in.bias": COLUMN,
    "mlp.fc_out.weight": ROW,
    # Added once, after the all-reduce that attention and MLP share.
    "mlp.fc_out.bias": REPLICATED,
}


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("decoder", NAME, build, "GPT-J block: parallel attention (interleaved rotary) and gelu_new MLP",
                 shard_specs=SHARD_SPECS)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, DecoderOptions)


@hookimpl
def ipuft_register_model_families(registry: ModelFamilyRegistry) -> None:
    registry.add(GPTJ)
