"""The Hugging Face families of the Llama architecture, each made from its :class:`Description`.

:func:`read_config` reads a family's config.json into ipuft's keys (the shared shapes under ``model``, the
rest under ``plugins.llama``), :func:`write_config` writes them back for an export of a model from scratch,
and :func:`parameter_names` lists a complete model's weights; all three follow the description, so a family is
a :class:`~ipuft_llama.description.Description` and :func:`family` makes its
:class:`ipuft.families.ModelFamily`. What ipuft does not run (an activation or rope scaling it lacks, attention
dropout, a key of :attr:`Description.refused` with another value) is refused in one line. This module
imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from ipuft.errors import shown
from ipuft.families import HFConfigError, ModelFamily, config_flag, config_float, config_int
from ipuft_llama.description import BY_TYPE, DESCRIPTIONS, FULL, NORMS, SLIDING, Description

NAME = "llama"  # the component name of every role
SECTION = "llama"  # plugins.llama

_ROPE_TYPES = ("llama3", "linear")

# The largest rope scaling factor ipuft takes: real ones are 2 to 64; beyond this every frequency is ~0.
MAX_ROPE_FACTOR = 1e4


def _rope(config: Mapping, default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """The rotary base and ``plugins.llama.rope_scaling`` (null, Llama 3.1's ``llama3`` scaling, or ``linear``
    position interpolation), as transformers 5 reads them from a config.json that may hold the older
    ``rope_theta`` and ``rope_scaling`` (the Hub's checkpoints), the one ``rope_parameters`` object transformers 5
    writes, or both: a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole; the chosen object's
    ``rope_theta`` wins over the top-level ``rope_theta``, which wins over ``default_theta``; its ``rope_type``
    (or ``type``) defaults to ``default``; Llama 3.1's ``original_max_position_embeddings`` defaults to
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
        theta = config_float(config, "rope_theta", default_theta)
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


def _layer_ropes(config: Mapping, d: Description) -> tuple[float, dict | None, float | None]:
    """The global layers' rotary base and scaling, and the sliding layers' own base (None: the same rotary).
    With :attr:`Description.local_rope`, transformers 5's ``rope_parameters`` has one object per layer type;
    a Hub config.json has ``rope_theta``, ``rope_scaling`` (the global layers') and ``rope_local_base_freq``."""
    default_theta = d.defaults.get("rope_theta", 10000.0)
    if not d.local_rope:
        return (*_rope(config, default_theta), None)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL in params and not config.get("rope_scaling"):
        local = params.get(SLIDING) or {}
        theta, scaling = _rope({"rope_parameters": params[FULL], "rope_theta": config.get("rope_theta"),
                                "max_position_embeddings": config.get("max_position_embeddings")}, default_theta)
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise HFConfigError(f"rope_parameters.{SLIDING} must be a default rope (a rope_theta), got "
                                f"{shown(local)}")
        return theta, scaling, config_float(local, "rope_theta", d.defaults.get("rope_local_base_freq", 10000.0))
    theta, scaling = _rope(config, default_theta)
    return theta, scaling, config_float(config, "rope_local_base_freq", d.defaults.get("rope_local_base_freq"))


def _biases(config: Mapping, d: Description) -> tuple[bool, bool, bool]:
    """q/k/v, output and MLP biases."""
    if d.attention_bias == "qkv":  # Qwen2's attention always has q/k/v biases, never an output bias
        qkv, out = True, False
    elif d.attention_bias == "key":
        qkv = out = config_flag(config, "attention_bias", False)
    else:
        qkv = out = False
    mlp = config_flag(config, "mlp_bias", False)
    if mlp and not d.mlp_bias:
        raise HFConfigError(f"mlp_bias=true: {d.title}'s MLP has no biases in transformers; ipuft runs none")
    return qkv, out, mlp


def _refused(config: Mapping, d: Description) -> None:
    """One line for a key whose value changes the arithmetic in a way ipuft does not run."""
    act = config.get(d.activation_key, d.activations[0])
    if act not in d.activations:
        mlp = "SwiGLU" if d.activations == ("silu",) else "gated"
        raise HFConfigError(f"{d.activation_key} {str(act)[:40]!r}: ipuft runs {d.model_type}'s {mlp} MLP with "
                            f"{' or '.join(d.activations)} only")
    if config.get("attention_dropout") not in (None, 0, 0.0):
        raise HFConfigError(f"attention_dropout={str(config['attention_dropout'])[:40]}: ipuft's Llama attention "
                            f"has no dropout (model.dropout_prob drops the residual branches instead); set it to 0")
    for key, values in d.refused.items():
        if config.get(key) not in values:
            ran = ", ".join("null" if v is None else str(v).lower() for v in values)
            raise HFConfigError(f"{key}={str(config[key])[:40]}: ipuft runs {d.title} with {key} {ran} only")


def _float_or_none(config: Mapping, key: str, default: Any) -> float | None:
    return None if config.get(key, default) is None else config_float({key: config.get(key, default)}, key)


def described(d: Description | str) -> Description:
    """``d``, or the description of model_type ``d``."""
    return BY_TYPE[d] if isinstance(d, str) else d


def read_config(config: Mapping, d: Description | str) -> dict[str, Any]:
    """A config.json of family ``d`` (a description or its model_type) as ipuft config keys, every value
    checked."""
    d = described(d)
    config = {**{k: v for k, v in d.defaults.items() if k not in config}, **config}
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    layers = config_int(config, "num_hidden_layers")
    kv_heads = config_int(config, "num_key_value_heads", heads)
    if hidden % heads and config.get("head_dim") is None:
        raise HFConfigError(f"num_attention_heads={heads} does not divide hidden_size={hidden} and no head_dim "
                            f"is given")
    head_dim = config_int(config, "head_dim", hidden // heads)
    if heads % kv_heads:
        raise HFConfigError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if head_dim % 2:
        raise HFConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    _refused(config, d)
    qkv_bias, out_bias, mlp_bias = _biases(config, d)
    window, types = d.layer_types(config, layers)
    theta, scaling, local_theta = _layer_ropes(config, d)
    if types is None or SLIDING not in types:
        local_theta = None  # no sliding layer reads it
    section = f"plugins.{SECTION}"
    return {
        "model.layers": layers,
        "model.hidden_size": hidden,
        "model.intermediate_size": config_int(config, "intermediate_size"),
        "model.attention.heads": heads,
        "model.attention.rotary_dim": head_dim,
        "model.attention.rotary_positional_embeddings_base": theta,
        "model.embedding.vocab_size": config_int(config, "vocab_size"),
        "model.layer_norm_epsilon": config_float(config, "rms_norm_eps", 1e-6, high=1.0),
        "model.tie_embeddings": config_flag(config, "tie_word_embeddings", False),
        f"{section}.kv_heads": kv_heads,
        f"{section}.head_dim": head_dim,
        f"{section}.qkv_bias": qkv_bias,
        f"{section}.output_bias": out_bias,
        f"{section}.sliding_window": window,
        f"{section}.rope_scaling": scaling,
        **_block_keys(config, d, mlp_bias, types, local_theta),
    }


def _block_keys(config: Mapping, d: Description, mlp_bias: bool, types: list[str] | None,
                local_theta: float | None) -> dict[str, Any]:
    """The ``plugins.llama`` options beyond the shapes: what the description fixes and what config.json sets."""
    section = f"plugins.{SECTION}"
    scalar = _float_or_none(config, "query_pre_attn_scalar", None) if d.query_pre_attn_scalar else None
    return {
        **{f"{section}.{k}": v for k, v in d.block_options().items()},
        f"{section}.mlp_bias": mlp_bias,
        f"{section}.activation": config.get(d.activation_key, d.activations[0]),
        f"{section}.query_pre_attn_scalar": scalar,
        f"{section}.attn_logit_softcap": _float_or_none(config, "attn_logit_softcapping", None)
        if d.attn_softcap else None,
        f"{section}.final_logit_softcap": _float_or_none(config, "final_logit_softcapping", None)
        if d.final_softcap else None,
        f"{section}.layer_types": types,
        f"{section}.local_rope_theta": local_theta,
        f"{section}.padding_idx": _padding_idx(config),
    }


def _padding_idx(config: Mapping) -> int | None:
    """config.json's ``pad_token_id``: transformers' embeddings give that row no gradient."""
    pad = config_int(config, "pad_token_id", None, minimum=0)
    vocab = config_int(config, "vocab_size")
    if pad is not None and pad >= vocab:
        raise HFConfigError(f"pad_token_id={pad} must be below vocab_size={vocab}")
    return pad


def head_dim(cfg: DictConfig) -> int:
    """The run's head width: ``plugins.llama.head_dim``, else hidden over heads."""
    m, dim = cfg.model, cfg.plugins[SECTION].head_dim
    return m.hidden_size // m.attention.heads if dim is None else dim


def kv_heads(cfg: DictConfig) -> int:
    """The run's key/value heads: ``plugins.llama.kv_heads``, else as many as the query heads."""
    kv = cfg.plugins[SECTION].kv_heads
    return cfg.model.attention.heads if kv is None else kv


def _scaling(options: DictConfig) -> dict | None:
    return None if options.rope_scaling is None else {
        k: v for k, v in dict(options.rope_scaling).items() if v is not None}


def _rope_keys(cfg: DictConfig, d: Description) -> dict[str, Any]:
    options = cfg.plugins[SECTION]
    theta = float(cfg.model.attention.rotary_positional_embeddings_base)
    if not d.local_rope:
        return {"rope_theta": theta, "rope_scaling": _scaling(options)}
    local = options.local_rope_theta if options.local_rope_theta is not None else theta
    full = {"rope_type": "default", **(_scaling(options) or {}), "rope_theta": theta}
    return {"rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": float(local)}}}


def write_config(cfg: DictConfig, d: Description | str) -> dict[str, Any]:
    """The run's config as a config.json of family ``d`` (the inverse of :func:`read_config`)."""
    d = described(d)
    m, options = cfg.model, cfg.plugins[SECTION]
    types = None if options.layer_types is None else list(options.layer_types)
    out: dict[str, Any] = {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.attention.heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": head_dim(cfg),
        d.activation_key: options.activation,
        "max_position_embeddings": max(m.sequence_length, 2048),
        "rms_norm_eps": m.layer_norm_epsilon,
        **_rope_keys(cfg, d),
        "vocab_size": m.embedding.vocab_size,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **d.layer_types.write(options.sliding_window, types, m.layers),
        "pad_token_id": options.padding_idx,
        **d.written,
    }
    if d.attention_bias == "key":
        out["attention_bias"] = options.qkv_bias
    if d.mlp_bias:
        out["mlp_bias"] = options.mlp_bias
    if d.query_pre_attn_scalar:  # an int in transformers' Gemma configs (they refuse 256.0)
        scalar = options.query_pre_attn_scalar
        out["query_pre_attn_scalar"] = int(scalar) if scalar is not None and scalar == int(scalar) else scalar
    if d.attn_softcap:
        out["attn_logit_softcapping"] = options.attn_logit_softcap
    if d.final_softcap:
        out["final_logit_softcapping"] = options.final_logit_softcap
    return out


def check_options(cfg: DictConfig, d: Description | str) -> None:
    """What an export as family ``d`` cannot say: biases its config.json has no key for (Llama's one
    ``attention_bias`` covers q/k/v and the output together, Mistral has none, Qwen2 has q/k/v biases only),
    and block options other than the family's."""
    d, options = described(d), cfg.plugins[SECTION]
    biases = (options.qkv_bias, options.output_bias)
    allowed = {"key": ((False, False), (True, True)), "none": ((False, False),), "qkv": ((True, False),)}
    if biases not in allowed[d.attention_bias]:
        raise HFConfigError(f"plugins.llama.qkv_bias={options.qkv_bias} with output_bias={options.output_bias} "
                            f"cannot be written as a {d.model_type} config.json")
    fixed = {**d.block_options(), **({} if d.mlp_bias else {"mlp_bias": False}),
             **({} if d.query_pre_attn_scalar else {"query_pre_attn_scalar": None}),
             **({} if d.attn_softcap else {"attn_logit_softcap": None}),
             **({} if d.final_softcap else {"final_logit_softcap": None}),
             **({} if d.local_rope else {"local_rope_theta": None})}
    for key, value in fixed.items():
        if options[key] != value:
            raise HFConfigError(f"plugins.llama.{key}={options[key]} cannot be written as a {d.model_type} "
                                f"config.json (its {d.title} models have {value})")
    if options.activation not in d.activations:
        raise HFConfigError(f"plugins.llama.activation={options.activation} cannot be written as a {d.model_type} "
                            f"config.json ({' or '.join(d.activations)})")


def layer_names(options: DictConfig) -> list[str]:
    """One layer's parameter names (local, and under ``model.layers.N.`` in a Hugging Face checkpoint)."""
    names = [f"{n}.weight" for n in NORMS[options.norms] if n is not None]
    names += [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if options.qk_norm is not None:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if options.qkv_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if options.output_bias:
        names.append("self_attn.o_proj.bias")
    if options.mlp_bias:
        names += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    return names


def parameter_names(cfg: DictConfig) -> set[str]:
    """Every parameter name of a complete transformers model of this family and ``cfg``'s shapes."""
    layer = layer_names(cfg.plugins[SECTION])
    head = set() if cfg.model.tie_embeddings else {"lm_head.weight"}  # tied: the embeddings' table
    return {"model.embed_tokens.weight", "model.norm.weight", *head,
            *(f"model.layers.{n}.{name}" for n in range(cfg.model.layers) for name in layer)}


# The config.json key behind each ipuft key read_config sets (for messages).
SOURCE_KEYS = {
    "model.layers": "num_hidden_layers", "model.hidden_size": "hidden_size",
    "model.intermediate_size": "intermediate_size", "model.attention.heads": "num_attention_heads",
    "model.attention.rotary_dim": "head_dim", "model.attention.rotary_positional_embeddings_base": "rope_theta",
    "model.embedding.vocab_size": "vocab_size", "model.layer_norm_epsilon": "rms_norm_eps",
    "model.tie_embeddings": "tie_word_embeddings",
    f"plugins.{SECTION}.kv_heads": "num_key_value_heads", f"plugins.{SECTION}.head_dim": "head_dim",
    f"plugins.{SECTION}.rope_scaling": "rope_scaling", f"plugins.{SECTION}.sliding_window": "sliding_window",
    f"plugins.{SECTION}.mlp_bias": "mlp_bias", f"plugins.{SECTION}.layer_types": "layer_types",
    f"plugins.{SECTION}.query_pre_attn_scalar": "query_pre_attn_scalar",
    f"plugins.{SECTION}.attn_logit_softcap": "attn_logit_softcapping",
    f"plugins.{SECTION}.final_logit_softcap": "final_logit_softcapping",
    f"plugins.{SECTION}.local_rope_theta": "rope_local_base_freq",
    f"plugins.{SECTION}.padding_idx": "pad_token_id",
}

# The plugins.llama options that make a model what it is (beside the shapes under model).
OPTION_KEYS = ("kv_heads", "head_dim", "qkv_bias", "output_bias", "sliding_window", "rope_scaling", "mlp_bias",
               "activation", "norms", "norm_offset", "norm_gain_float32", "qk_norm", "embedding_scale",
               "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "layer_types",
               "local_rope_theta", "padding_idx")

# Every key read_config sets: a checkpoint of the family fixes them (ipuft.config.identity).
MODEL_KEYS = (
    "model.layers", "model.hidden_size", "model.intermediate_size", "model.attention.heads",
    "model.attention.rotary_dim", "model.attention.rotary_positional_embeddings_base", "model.embedding.vocab_size",
    "model.layer_norm_epsilon", *(f"plugins.{SECTION}.{key}" for key in OPTION_KEYS),
)  # fmt: skip


def family(d: Description) -> ModelFamily:
    """The :class:`ipuft.families.ModelFamily` of description ``d``: the ``llama`` components, config.json read
    and written as ``d`` says."""

    def write(cfg: DictConfig) -> dict[str, Any]:
        check_options(cfg, d)
        return write_config(cfg, d)

    return ModelFamily(
        model_type=d.model_type,
        title=d.title,
        architecture=d.architecture,
        components={"embeddings": NAME, "decoder": NAME, "head": NAME},
        read_config=lambda config: read_config(config, d),
        write_config=write,
        parameter_names=parameter_names,
        source_keys=SOURCE_KEYS,
        positions_key="max_position_embeddings",
        model_keys=MODEL_KEYS,
        description=f"{d.title}: RMSNorm ({d.norms}), rotate-half rotary, grouped-query attention, gated MLP",
    )


FAMILIES = [family(d) for d in DESCRIPTIONS]
