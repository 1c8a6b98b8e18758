"""Llama-architecture models for ipuft: the ``llama`` embeddings, decoder and head, their options
(``plugins.llama``), and the Hugging Face families that read and write them (``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``olmo2``, ``gemma2``, ``gemma3_text``, ``phi3``: Phi-3 and Phi-4), each a
:class:`~ipuft_llama.description.Description` (see :mod:`ipuft_llama.family`).

``model.hf_checkpoint=DIR`` with one of their config.json selects these components and sets every option from
it; the ``llama3-8b``, ``mistral-7b``, ``qwen3-8b`` and ``phi4`` presets set them for a run from scratch or a plan.

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
from ipuft_llama.description import ACTIVATIONS, FULL, NORMS, PLACEMENTS, QK_NORMS, SLIDING
from ipuft_llama.family import FAMILIES, MAX_ROPE_FACTOR, NAME, SECTION, head_dim, kv_heads

if TYPE_CHECKING:
    from ipuft.embeddings import TokenEmbeddings
    from ipuft_llama.modules import LlamaDecoderBlock, LlamaLMHead


@dataclass
class RopeScaling:
    """Rotary frequency scaling: ``llama3`` (Llama 3.1's), ``linear`` (position interpolation) or ``longrope``
    (Phi-3's: a factor per frequency, short or long, and an attention factor on cos and sin; ``factor`` unused)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: Optional[float] = 1.0
    high_freq_factor: Optional[float] = 4.0
    original_max_position_embeddings: Optional[int] = 8192
    short_factor: Optional[list[float]] = None
    long_factor: Optional[list[float]] = None
    attention_factor: Optional[float] = None


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
    # Sliding-window attention (Mistral, Qwen2/3's use_sliding_window, Gemma's local layers): on the layers
    # layer_types names (every layer when it is null), each query sees the keys of its last sliding_window
    # positions, itself included; null: every earlier position.
    sliding_window: Optional[int] = None
    # Each layer's attention, full_attention or sliding_attention (sliding_window); null: every layer the
    # window's if there is one (Mistral), else full.
    layer_types: Optional[list[str]] = None
    # The sliding layers' rotary base (Gemma 3's rope_local_base_freq; they take no rope_scaling); null: the
    # model's rotary on every layer.
    local_rope_theta: Optional[float] = None
    # Biases on the MLP's gate, up and down projections (Llama's mlp_bias).
    mlp_bias: bool = False
    # The gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU, tanh approximation).
    activation: str = "silu"
    # Where the RMSNorms sit: pre (before attention and MLP), sandwich (before and after each: Gemma 2/3),
    # post (after each, none before: OLMo 2).
    norms: str = "pre"
    # The norm's gain is 1 + weight (Gemma) instead of weight.
    norm_offset: bool = False
    # The gain multiplies the float32 normed value before it is rounded to the activations' dtype (OLMo 2,
    # Gemma); false: the normed value is rounded first (Llama, Qwen).
    norm_gain_float32: bool = False
    # An RMSNorm on q and k before rotary, over each head (head: Qwen3, Gemma 3) or over the whole projected
    # width (width: OLMo 2); null: none.
    qk_norm: Optional[str] = None
    # The embeddings are multiplied by sqrt(model.hidden_size), rounded to the model's dtype (Gemma).
    embedding_scale: bool = False
    # config.json's pad_token_id: that token's embedding row gets no gradient (transformers' padding_idx).
    padding_idx: Optional[int] = None
    # The attention's softmax scale is query_pre_attn_scalar ** -0.5 (Gemma); null: head_dim ** -0.5.
    query_pre_attn_scalar: Optional[float] = None
    # Soft-caps: scores <- cap * tanh(scores / cap) on the attention scores and on the logits (Gemma 2).
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    # Phi-3: the checkpoint holds q, k and v stacked in one tensor (qkv_proj) and gate and up in another
    # (gate_up_proj); ipuft splits them at import and stacks them again at export (ipuft_llama.phi3).
    fused_projections: bool = False


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
    if not (0 < m.attention.rotary_dim <= dim and m.attention.rotary_dim % 2 == 0):
        raise ConfigError(f"model.attention.rotary_dim={m.attention.rotary_dim}: the Llama decoder rotates the first "
                          f"rotary_dim dimensions of each head, an even number up to the head width {dim}")
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
    scaling = options.rope_scaling
    if scaling is not None:
        _check_rope_scaling(scaling, m.attention.rotary_dim)
    _check_block(cfg)


def _check_block(cfg: DictConfig) -> None:
    """The block's options (norms, activation, soft-caps, layer types), one line each."""
    m, options = cfg.model, cfg.plugins[SECTION]
    for key, choices in (("norms", PLACEMENTS), ("activation", ACTIVATIONS), ("qk_norm", (None, *QK_NORMS))):
        if options[key] not in choices:
            raise ConfigError(f"plugins.llama.{key}={options[key]}: one of {', '.join(map(str, choices))}")
    for key in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
        value = options[key]
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"plugins.llama.{key}: a finite number > 0 or null, got {value}")
    types = options.layer_types
    if types is not None:
        if len(types) != m.layers or any(t not in (FULL, SLIDING) for t in types):
            raise ConfigError(f"plugins.llama.layer_types: {m.layers} entries (model.layers), each {FULL} or "
                              f"{SLIDING}, got {list(types)}")
        if SLIDING in types and options.sliding_window is None:
            raise ConfigError("plugins.llama.layer_types names sliding_attention layers but "
                              "plugins.llama.sliding_window is null")
    if options.qk_norm == "width" and cfg.execution.tensor_parallel > 1:
        raise ConfigError(f"plugins.llama.qk_norm=width (OLMo 2) normalises q and k over every head, which "
                          f"execution.tensor_parallel={cfg.execution.tensor_parallel} splits; run it at TP=1")


def _check_rope_scaling(scaling: DictConfig, rotary_dim: int) -> None:
    """A rope scaling ipuft computes: a known kind, a factor in (0, MAX_ROPE_FACTOR] (0 divides every
    frequency by zero), finite positive llama3 bounds, longrope's factors one finite positive number per
    rotated pair."""
    if scaling.rope_type not in ("llama3", "linear", "longrope"):
        raise ConfigError(f"plugins.llama.rope_scaling.rope_type={scaling.rope_type!r}: one of llama3, linear, "
                          f"longrope")
    if scaling.rope_type == "longrope":
        from ipuft_llama.phi3 import check_longrope

        check_longrope(scaling, rotary_dim)
        return
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
    """Core's token embeddings with Llama's names (``embed_tokens``, ``model.embed_tokens.weight``), scaled by
    sqrt(hidden) where ``plugins.llama.embedding_scale`` says (Gemma), the ``padding_idx`` row without a
    gradient."""
    from ipuft_llama.modules import LlamaEmbeddings

    m, options = cfg.model, cfg.plugins[SECTION]
    if options.padding_idx is not None and not 0 <= options.padding_idx < m.embedding.vocab_size:
        raise ConfigError(f"plugins.llama.padding_idx={options.padding_idx}: a token id below "
                          f"model.embedding.vocab_size={m.embedding.vocab_size}, or null")
    return LlamaEmbeddings(m.embedding.vocab_size, m.hidden_size, m.dropout_prob, cfg.execution.tensor_parallel,
                           table_name="embed_tokens", hf_name="model.embed_tokens.weight",
                           scale=options.embedding_scale, padding_idx=options.padding_idx)


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
        tensor_parallel=cfg.execution.tensor_parallel, block=block_arithmetic(cfg), rotary_dim=m.attention.rotary_dim,
        longest=m.sequence_length, fused_projections=options.fused_projections)


def block_arithmetic(cfg: DictConfig):
    """``plugins.llama``'s block options as the module's :class:`~ipuft_llama.modules.BlockArithmetic`."""
    from ipuft_llama.modules import BlockArithmetic

    m, options = cfg.model, cfg.plugins[SECTION]
    types = [FULL] * m.layers if options.layer_types is None else list(options.layer_types)
    if options.layer_types is None and options.sliding_window is not None:
        types = [SLIDING] * m.layers  # Mistral: the window on every layer
    windows = tuple(options.sliding_window if t == SLIDING else None for t in types)
    return BlockArithmetic(
        norms=NORMS[options.norms], norm_offset=options.norm_offset, norm_gain_float32=options.norm_gain_float32,
        qk_norm=options.qk_norm, activation=options.activation, mlp_bias=options.mlp_bias,
        query_pre_attn_scalar=options.query_pre_attn_scalar, attn_logit_softcap=options.attn_logit_softcap,
        windows=windows, local_rope_theta=options.local_rope_theta)


def build_head(cfg: DictConfig) -> LlamaLMHead:
    from ipuft_llama.modules import LlamaLMHead

    m, options = cfg.model, cfg.plugins[SECTION]
    return LlamaLMHead(m.hidden_size, m.embedding.vocab_size, m.layer_norm_epsilon, cfg.execution.tensor_parallel,
                       tied=m.tie_embeddings, norm_offset=options.norm_offset,
                       norm_gain_float32=options.norm_gain_float32, softcap=options.final_logit_softcap)


def decoder_shard_specs(variables: list[VariableSpec], tensor_parallel: int, cfg: DictConfig) -> dict[str, ShardSpec]:
    """q and the MLP's gate and up (and their biases) by output rows, o and down by input columns; k and v by
    output rows when TP divides the key/value heads, else whole on every rank (see :mod:`ipuft.attention`);
    the norms (per-head q/k norms too: every head has the same) and the o and down biases whole. It depends
    on the run's config, so the plugin gives it by ``ipuft_shard_spec``."""
    kv = COLUMN if kv_heads(cfg) % tensor_parallel == 0 else REPLICATED
    specs = {**{f"{n}.weight": REPLICATED for n in NORMS["sandwich"]},
             "self_attn.q_norm.weight": REPLICATED, "self_attn.k_norm.weight": REPLICATED,
             "mlp.gate_proj.bias": COLUMN, "mlp.up_proj.bias": COLUMN, "mlp.down_proj.bias": REPLICATED,
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
                 "Llama-architecture block: RMSNorms (pre, sandwich or post), rotate-half rotary, grouped-query "
                 "attention, gated MLP")
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
    from ipuft_llama.phi3 import FAMILY as PHI3

    for family in [*FAMILIES, PHI3]:
        registry.add(family)
