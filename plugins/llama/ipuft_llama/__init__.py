"""Llama-architecture models for ipuft: the ``llama`` embeddings, decoder and head, their options
(``plugins.llama``), and the Hugging Face families that read and write them (``llama``, ``mistral``,
``qwen2``; see :mod:`ipuft_llama.family`).

``model.hf_checkpoint=DIR`` with a Llama, Mistral or Qwen2 config.json selects these components and sets
every option from it; the ``llama3-8b`` and ``mistral-7b`` presets set them for a run from scratch or a plan.

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the modules are in :mod:`ipuft_llama.modules`, imported when a run builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.families import ModelFamilyRegistry
from ipuft.sharding import COLUMN, REPLICATED, ROW, VOCAB_SHARDED, ShardSpec
from ipuft_llama.family import FAMILIES, MAX_ROPE_FACTOR, NAME, SECTION, head_dim, kv_heads

if TYPE_CHECKING:
    from ipuft.embeddings import TokenEmbeddings
    from ipuft_llama.modules import LlamaDecoderBlock, LlamaLMHead


@dataclass
class RopeScaling:
    """Rotary frequency scaling: ``llama3`` (Llama 3.1's) or ``linear`` (position interpolation)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: Optional[float] = 1.0
    high_freq_factor: Optional[float] = 4.0
    original_max_position_embeddings: Optional[int] = 8192


@dataclass
class LlamaOptions:
    """``plugins.llama``: what a Llama-architecture model has beyond ``model``'s shapes. A Hugging Face
    checkpoint's config.json sets every one of them."""

    # Key/value heads (grouped-query attention); null: as many as model.attention.heads.
    kv_heads: Optional[int] = None
    # Each head's width; null: model.hidden_size / model.attention.heads.
    head_dim: Optional[int] = None
    # Biases on the q, k and v projections (Qwen2; Llama's attention_bias), and on the output projection
    # (Llama's attention_bias).
    qkv_bias: bool = False
    output_bias: bool = False
    # null, or Llama 3.1's frequency scaling.
    rope_scaling: Optional[RopeScaling] = None
    # Mistral's (and Qwen2's use_sliding_window) sliding-window attention: each query sees the keys of its
    # last sliding_window positions, itself included; null: every earlier position.
    sliding_window: Optional[int] = None
    # Qwen2's max_window_layers: the layers below it attend over every earlier position, the others within
    # sliding_window; null: every layer within it (Mistral).
    max_window_layers: Optional[int] = None


def _check(cfg: DictConfig) -> None:
    """The options' rules, one line each."""
    m, options = cfg.model, cfg.plugins[SECTION]
    for key, unset in (("kv_heads", "as many as model.attention.heads"), ("head_dim", "hidden_size / heads")):
        value = options[key]
        if value is not None and not 0 < value <= 1 << 16:
            raise ConfigError(f"plugins.llama.{key}: must be a positive integer of at most {1 << 16} (null: "
                              f"{unset}), got {value}")
    heads, kv, dim = m.attention.heads, kv_heads(cfg), head_dim(cfg)
    if options.head_dim is None and m.hidden_size % heads:
        raise ConfigError(f"model.attention.heads={heads} does not divide model.hidden_size={m.hidden_size}; "
                          f"set plugins.llama.head_dim")
    if heads % kv:
        raise ConfigError(f"plugins.llama.kv_heads={kv} does not divide model.attention.heads={heads}")
    if m.attention.rotary_dim != dim:
        raise ConfigError(f"model.attention.rotary_dim={m.attention.rotary_dim}: the Llama decoder rotates whole "
                          f"heads, so it must equal the head width {dim}")
    if m.intermediate_size is None:
        raise ConfigError("model.intermediate_size: the Llama MLP needs its width set (null means 4 × hidden "
                          "only for GPT-J)")
    tp = cfg.execution.tensor_parallel
    if heads % tp or m.intermediate_size % tp:
        raise ConfigError(f"execution.tensor_parallel={tp} must divide model.attention.heads={heads} and "
                          f"model.intermediate_size={m.intermediate_size}")
    window = options.sliding_window
    if window is not None and not 0 < window <= 1 << 24:
        raise ConfigError(f"plugins.llama.sliding_window: must be a positive number of positions of at most "
                          f"{1 << 24} (null: no window), got {window}")
    first = options.max_window_layers
    if first is not None and first < 0:
        raise ConfigError(f"plugins.llama.max_window_layers: must be a layer count >= 0 (null: every layer has the "
                          f"window), got {first}")
    scaling = options.rope_scaling
    if scaling is not None:
        _check_rope_scaling(scaling)


def _check_rope_scaling(scaling: DictConfig) -> None:
    """A rope scaling ipuft computes: a known kind, a factor in (0, MAX_ROPE_FACTOR] (0 divides every
    frequency by zero), finite positive llama3 bounds."""
    if scaling.rope_type not in ("llama3", "linear"):
        raise ConfigError(f"plugins.llama.rope_scaling.rope_type={scaling.rope_type!r}: one of llama3, linear")
    factor = scaling.factor
    if not (math.isfinite(factor) and 0 < factor <= MAX_ROPE_FACTOR):
        raise ConfigError(f"plugins.llama.rope_scaling.factor: must be a number in (0, {MAX_ROPE_FACTOR:g}] (real "
                          f"ones are 2 to 64), got {factor}")
    if scaling.rope_type != "llama3":
        return
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    for key, value in (("low_freq_factor", low), ("high_freq_factor", high),
                       ("original_max_position_embeddings", scaling.original_max_position_embeddings)):
        if value is None or not (math.isfinite(value) and value > 0):
            raise ConfigError(f"plugins.llama.rope_scaling.{key}: llama3 scaling needs a finite number > 0, "
                              f"got {value}")
    if high <= low:
        raise ConfigError(f"plugins.llama.rope_scaling.high_freq_factor: must exceed low_freq_factor={low}, "
                          f"got {high}")


def build_embeddings(cfg: DictConfig) -> TokenEmbeddings:
    """Core's token embeddings with Llama's names (``embed_tokens``, ``model.embed_tokens.weight``)."""
    from ipuft.embeddings import TokenEmbeddings

    m = cfg.model
    return TokenEmbeddings(m.embedding.vocab_size, m.hidden_size, m.dropout_prob, cfg.execution.tensor_parallel,
                           table_name="embed_tokens", hf_name="model.embed_tokens.weight")


def build_decoder(cfg: DictConfig) -> LlamaDecoderBlock:
    from ipuft_llama.modules import LlamaDecoderBlock

    _check(cfg)
    m, options = cfg.model, cfg.plugins[SECTION]
    scaling = None if options.rope_scaling is None else dict(options.rope_scaling)
    return LlamaDecoderBlock(
        hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, heads=m.attention.heads,
        kv_heads=kv_heads(cfg), head_dim=head_dim(cfg), rms_norm_eps=m.layer_norm_epsilon,
        rope_theta=float(m.attention.rotary_positional_embeddings_base), rope_scaling=scaling,
        qkv_bias=options.qkv_bias, output_bias=options.output_bias, dropout_prob=m.dropout_prob,
        tensor_parallel=cfg.execution.tensor_parallel, sliding_window=options.sliding_window,
        max_window_layers=options.max_window_layers)


def build_head(cfg: DictConfig) -> LlamaLMHead:
    from ipuft_llama.modules import LlamaLMHead

    m = cfg.model
    return LlamaLMHead(m.hidden_size, m.embedding.vocab_size, m.layer_norm_epsilon, cfg.execution.tensor_parallel,
                       tied=m.tie_embeddings)


def decoder_shard_specs(variables: list[VariableSpec], tensor_parallel: int, cfg: DictConfig) -> dict[str, ShardSpec]:
    """q and the MLP's gate and up by output rows, o and down by input columns; k and v by output rows when
    TP divides the key/value heads, else whole on every rank (see :mod:`ipuft.attention`); the norms and o's
    bias whole. It depends on the run's config, so the plugin gives it by ``ipuft_shard_spec``."""
    kv = COLUMN if kv_heads(cfg) % tensor_parallel == 0 else REPLICATED
    specs = {"input_layernorm.weight": REPLICATED, "post_attention_layernorm.weight": REPLICATED,
             "self_attn.q_proj.weight": COLUMN, "self_attn.q_proj.bias": COLUMN,
             "self_attn.k_proj.weight": kv, "self_attn.k_proj.bias": kv,
             "self_attn.v_proj.weight": kv, "self_attn.v_proj.bias": kv,
             "self_attn.o_proj.weight": ROW, "self_attn.o_proj.bias": REPLICATED,
             "mlp.gate_proj.weight": COLUMN, "mlp.up_proj.weight": COLUMN, "mlp.down_proj.weight": ROW}
    return {v.name: specs[v.name] for v in variables}


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("embeddings", NAME, build_embeddings, "Llama token embedding (embed_tokens)",
                 shard_specs={"embed_tokens.weight": VOCAB_SHARDED})
    registry.add("decoder", NAME, build_decoder,
                 "Llama block: RMSNorm, rotate-half rotary, grouped-query attention, SwiGLU MLP")
    registry.add("head", NAME, build_head, "Llama LM head: RMSNorm, projection without bias (tied or not)",
                 shard_specs={"norm.weight": REPLICATED, "lm_head.weight": VOCAB_SHARDED})


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int,
                     cfg: DictConfig) -> dict[str, ShardSpec] | None:
    """The Llama decoder's layout (:func:`decoder_shard_specs`); ``None`` for every other component."""
    if (role, name) != ("decoder", NAME):
        return None
    return decoder_shard_specs(variables, tensor_parallel, cfg)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, LlamaOptions, used_when={"model.decoder": NAME})


@hookimpl
def ipuft_register_model_families(registry: ModelFamilyRegistry) -> None:
    for family in FAMILIES:
        registry.add(family)
