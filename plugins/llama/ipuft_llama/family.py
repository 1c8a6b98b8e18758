"""The Hugging Face families of the Llama architecture: ``llama``, ``mistral`` and ``qwen2``.

They share the components (:mod:`ipuft_llama.modules`) and differ in their config.json: Mistral may set a
``sliding_window`` and an explicit ``head_dim``; Qwen2 always has q/k/v biases and a ``use_sliding_window``
switch; Llama has ``attention_bias``, ``mlp_bias`` and Llama 3.1's ``rope_scaling``. Each reads its
config.json into ipuft's keys (the shared shapes under ``model``, the rest under ``plugins.llama``) and writes
it back for an export; what ipuft does not run (MLP biases, another activation, ``layer_types`` other than
the window's layers) is refused in one line. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from ipuft.errors import shown
from ipuft.families import HFConfigError, ModelFamily, config_flag, config_float, config_int

NAME = "llama"  # the component name of every role
SECTION = "llama"  # plugins.llama

_ROPE_TYPES = ("llama3", "linear")
# transformers' defaults where config.json lacks the key (MistralConfig, Qwen2Config); LlamaConfig has none.
_KV_HEADS_DEFAULT = {"mistral": 8, "qwen2": 32}
_WINDOW_DEFAULT = {"mistral": 4096, "qwen2": 4096}


# The largest rope scaling factor ipuft takes: real ones are 2 to 64; beyond this every frequency is ~0.
MAX_ROPE_FACTOR = 1e4


def _rope(config: Mapping) -> tuple[float, dict[str, Any] | None]:
    """The rotary base and ``plugins.llama.rope_scaling`` (null, Llama 3.1's ``llama3`` scaling, or ``linear``
    position interpolation), as transformers 5 reads them from a config.json that may hold the older
    ``rope_theta`` and ``rope_scaling`` (the Hub's checkpoints), the one ``rope_parameters`` object transformers 5
    writes, or both: a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole; the chosen object's
    ``rope_theta`` wins over the top-level ``rope_theta``, which wins over 10000; its ``rope_type`` (or ``type``)
    defaults to ``default``; Llama 3.1's ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise HFConfigError(f"{key} must be an object or null, got {shown(params)}")
    if params.get("rope_theta") is not None:
        theta = config_float(params, "rope_theta")
    else:
        theta = config_float(config, "rope_theta", 10000.0)
    return theta, _rope_scaling(params, key, config)


def _rope_scaling(scaling: dict, key: str, config: Mapping) -> dict[str, Any] | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("default", None):
        return None
    if kind not in _ROPE_TYPES:
        raise HFConfigError(f"{key}'s rope_type {str(kind)[:40]!r} is not one ipuft runs "
                            f"({', '.join(_ROPE_TYPES)})")
    try:
        out = {"rope_type": kind, "factor": config_float(scaling, "factor", low=0.0, high=MAX_ROPE_FACTOR)}
        if kind == "llama3":
            out["low_freq_factor"] = config_float(scaling, "low_freq_factor", low=0.0)
            out["high_freq_factor"] = config_float(scaling, "high_freq_factor", low=out["low_freq_factor"])
            original = "original_max_position_embeddings"
            source = scaling if scaling.get(original) is not None or config.get("max_position_embeddings") is None \
                else {original: config["max_position_embeddings"]}
            out[original] = config_int(source, original)
    except HFConfigError as exc:
        raise HFConfigError(f"{key}'s {exc}") from None
    return out


def read_config(config: Mapping, model_type: str) -> dict[str, Any]:
    """A Llama-architecture config.json as ipuft config keys, every value checked."""
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    # Absent, num_key_value_heads and sliding_window take their transformers config class's defaults (null: all
    # heads, no window).
    kv_default = _KV_HEADS_DEFAULT.get(model_type, heads) if "num_key_value_heads" not in config else heads
    kv_heads = config_int(config, "num_key_value_heads", kv_default)
    if hidden % heads and config.get("head_dim") is None:
        raise HFConfigError(f"num_attention_heads={heads} does not divide hidden_size={hidden} and no head_dim "
                            f"is given")
    head_dim = config_int(config, "head_dim", hidden // heads)
    if heads % kv_heads:
        raise HFConfigError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if head_dim % 2:
        raise HFConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act {str(act)[:40]!r}: ipuft runs {model_type}'s SwiGLU MLP with silu only")
    if config_flag(config, "mlp_bias", False):
        raise HFConfigError("mlp_bias=true: ipuft's Llama MLP has no biases")
    window = config.get("sliding_window", _WINDOW_DEFAULT.get(model_type))
    if model_type == "qwen2":
        qkv_bias, out_bias = True, False  # Qwen2's attention always has q/k/v biases, never an output bias
        window = window if config_flag(config, "use_sliding_window", False) else None
    else:
        qkv_bias = out_bias = config_flag(config, "attention_bias", False)
    if window is not None:
        window = config_int({"sliding_window": window}, "sliding_window")
    first = _window_layers(config, model_type, window)
    if config.get("attention_dropout") not in (None, 0, 0.0):
        raise HFConfigError(f"attention_dropout={str(config['attention_dropout'])[:40]}: ipuft's Llama attention "
                            f"has no dropout (model.dropout_prob drops the residual branches instead); set it to 0")
    theta, scaling = _rope(config)
    return {
        "model.layers": config_int(config, "num_hidden_layers"),
        "model.hidden_size": hidden,
        "model.intermediate_size": config_int(config, "intermediate_size"),
        "model.attention.heads": heads,
        "model.attention.rotary_dim": head_dim,
        "model.attention.rotary_positional_embeddings_base": theta,
        "model.embedding.vocab_size": config_int(config, "vocab_size"),
        "model.layer_norm_epsilon": config_float(config, "rms_norm_eps", 1e-6, high=1.0),
        "model.tie_embeddings": config_flag(config, "tie_word_embeddings", False),
        f"plugins.{SECTION}.kv_heads": kv_heads,
        f"plugins.{SECTION}.head_dim": head_dim,
        f"plugins.{SECTION}.qkv_bias": qkv_bias,
        f"plugins.{SECTION}.output_bias": out_bias,
        f"plugins.{SECTION}.sliding_window": window,
        f"plugins.{SECTION}.max_window_layers": first,
        f"plugins.{SECTION}.rope_scaling": scaling,
    }


def _window_layers(config: Mapping, model_type: str, window: int | None) -> int | None:
    """``plugins.llama.max_window_layers``: Qwen2's layers below ``max_window_layers`` (default 28, as
    Qwen2Config's) attend in full, the others within the window (null: every layer, or no window). A
    ``layer_types`` list must say the same (transformers reads it over ``max_window_layers``)."""
    if window is None or model_type != "qwen2":
        first = None
    else:
        first = config_int(config, "max_window_layers", 28, minimum=0)
    layers = config_int(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is not None:
        expected = ["sliding_attention" if window is not None and n >= (first or 0) else "full_attention"
                    for n in range(layers)]
        if list(types) != expected:
            raise HFConfigError(f"layer_types {shown(types)}: ipuft reads {model_type}'s windowed layers from "
                                f"sliding_window and max_window_layers, which give {shown(expected)}")
    return first


def head_dim(cfg: DictConfig) -> int:
    """The run's head width: ``plugins.llama.head_dim``, else hidden over heads."""
    m, dim = cfg.model, cfg.plugins[SECTION].head_dim
    return m.hidden_size // m.attention.heads if dim is None else dim


def kv_heads(cfg: DictConfig) -> int:
    """The run's key/value heads: ``plugins.llama.kv_heads``, else as many as the query heads."""
    kv = cfg.plugins[SECTION].kv_heads
    return cfg.model.attention.heads if kv is None else kv


def write_config(cfg: DictConfig, model_type: str) -> dict[str, Any]:
    """The run's config as a Llama-architecture config.json (the inverse of :func:`read_config`)."""
    m, options = cfg.model, cfg.plugins[SECTION]
    out: dict[str, Any] = {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.attention.heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "max_position_embeddings": max(m.sequence_length, 2048),
        "rms_norm_eps": m.layer_norm_epsilon,
        "rope_theta": float(m.attention.rotary_positional_embeddings_base),
        "rope_scaling": None if options.rope_scaling is None else {
            k: v for k, v in dict(options.rope_scaling).items() if v is not None},
        "vocab_size": m.embedding.vocab_size,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if model_type == "qwen2":
        first = options.max_window_layers
        out.update(use_sliding_window=options.sliding_window is not None,
                   sliding_window=options.sliding_window,
                   max_window_layers=m.layers if options.sliding_window is None else first or 0)
    elif model_type == "mistral":
        out["sliding_window"] = options.sliding_window
    else:
        out.update(attention_bias=options.qkv_bias, mlp_bias=False)
    return out


def check_options(cfg: DictConfig, model_type: str) -> None:
    """What an export as ``model_type`` cannot say: Llama's one ``attention_bias`` covers q/k/v and the output
    together, Mistral has none, Qwen2 has q/k/v biases only."""
    options = cfg.plugins[SECTION]
    biases = (options.qkv_bias, options.output_bias)
    allowed = {"llama": ((False, False), (True, True)), "mistral": ((False, False),), "qwen2": ((True, False),)}
    if biases not in allowed[model_type]:
        raise HFConfigError(f"plugins.llama.qkv_bias={options.qkv_bias} with output_bias={options.output_bias} "
                            f"cannot be written as a {model_type} config.json")


def parameter_names(cfg: DictConfig) -> set[str]:
    """Every parameter name of a complete transformers model of this family and ``cfg``'s shapes."""
    options = cfg.plugins[SECTION]
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight",
             *(f"self_attn.{p}_proj.weight" for p in "qkv")]
    if options.qkv_bias:
        layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if options.output_bias:
        layer.append("self_attn.o_proj.bias")
    head = set() if cfg.model.tie_embeddings else {"lm_head.weight"}  # tied: the embeddings' table
    return {"model.embed_tokens.weight", "model.norm.weight", *head,
            *(f"model.layers.{n}.{name}" for n in range(cfg.model.layers) for name in layer)}


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TITLES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
# The config.json key behind each ipuft key read_config sets (for messages).
SOURCE_KEYS = {
    "model.layers": "num_hidden_layers", "model.hidden_size": "hidden_size",
    "model.intermediate_size": "intermediate_size", "model.attention.heads": "num_attention_heads",
    "model.attention.rotary_dim": "head_dim", "model.attention.rotary_positional_embeddings_base": "rope_theta",
    "model.embedding.vocab_size": "vocab_size", "model.layer_norm_epsilon": "rms_norm_eps",
    "model.tie_embeddings": "tie_word_embeddings",
    f"plugins.{SECTION}.kv_heads": "num_key_value_heads", f"plugins.{SECTION}.head_dim": "head_dim",
    f"plugins.{SECTION}.rope_scaling": "rope_scaling", f"plugins.{SECTION}.sliding_window": "sliding_window",
    f"plugins.{SECTION}.max_window_layers": "max_window_layers",
}


# Every key read_config sets: a checkpoint of the family fixes them (ipuft.config.identity).
MODEL_KEYS = (
    "model.layers", "model.hidden_size", "model.intermediate_size", "model.attention.heads",
    "model.attention.rotary_dim", "model.attention.rotary_positional_embeddings_base", "model.embedding.vocab_size",
    "model.layer_norm_epsilon", *(f"plugins.{SECTION}.{key}" for key in (
        "kv_heads", "head_dim", "qkv_bias", "output_bias", "sliding_window", "max_window_layers", "rope_scaling")),
)  # fmt: skip


def family(model_type: str) -> ModelFamily:
    def write(cfg: DictConfig) -> dict[str, Any]:
        check_options(cfg, model_type)
        return write_config(cfg, model_type)

    return ModelFamily(
        model_type=model_type,
        title=_TITLES[model_type],
        architecture=_ARCHITECTURES[model_type],
        components={"embeddings": NAME, "decoder": NAME, "head": NAME},
        read_config=lambda config: read_config(config, model_type),
        write_config=write,
        parameter_names=parameter_names,
        source_keys=SOURCE_KEYS,
        positions_key="max_position_embeddings",
        model_keys=MODEL_KEYS,
        description=f"{_TITLES[model_type]}: RMSNorm, rotate-half rotary, grouped-query attention, SwiGLU",
    )


FAMILIES = [family(t) for t in _ARCHITECTURES]
