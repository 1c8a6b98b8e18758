"""Phi-3 and Phi-4 (config.json ``model_type`` ``phi3``, transformers' ``Phi3ForCausalLM``) on the Llama block.

A Phi-3 layer computes what a Llama layer does; three things differ, each a ``plugins.llama`` option or a
``model`` key this family sets from config.json:

- fused projections (``plugins.llama.fused_projections``): the checkpoint holds q, k and v stacked by rows in
  one tensor, ``self_attn.qkv_proj.weight`` = ``[q; k; v]``, and gate and up in ``mlp.gate_up_proj.weight`` =
  ``[gate; up]`` (:func:`fused_rows`, core's :class:`ipuft.components.FusedRows`). ipuft holds them as the
  Llama block's separate variables: an import splits them, an export stacks them again, and everything between
  (the plan, the store, TP sharding, LoRA, the optimizer) sees Llama's variables;
- partial rotary (``partial_rotary_factor``, Phi-4-mini's 0.75): the first ``int(head_dim · factor)``
  dimensions of each head turn (``model.attention.rotary_dim``);
- ``longrope`` (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): a factor per frequency, ``short_factor`` or
  ``long_factor``, and an attention factor on cos and sin (``plugins.llama.rope_scaling``; see
  :func:`ipuft.attention.inverse_frequencies`). The long factors apply when the run's ``model.sequence_length``
  exceeds ``original_max_position_embeddings``, for every position of every call (training, eval and
  generation, which ``model.sequence_length`` bounds): a row as long as the run's sequences turns as
  transformers turns it. transformers chooses per call by its last position, and recomputes a generation
  whole once it crosses the original context; ipuft's choice is one per run, so that a cache stays valid.

Phi-4 (14B) is the same family with a 100352-token vocabulary, full rotary and no longrope.

The family is a :class:`~ipuft_llama.description.Description` (:data:`PHI3`: Llama's pre-norm block without
biases) read by :mod:`ipuft_llama.family`, plus what this module reads beside it: the rope, the partial
rotary and the fused names. Refused: ``resid_pdrop`` and ``attention_dropout`` other than 0 (ipuft takes no
dropout from a checkpoint: ``model.dropout_prob`` is the run's choice); ``embd_pdrop`` is read by nothing,
as in transformers' Phi-3. ``pad_token_id`` is read as every family reads it (``plugins.llama.padding_idx``:
the pad row gets no gradient, as transformers' embedding's ``padding_idx`` has it) and written back.
``sliding_window`` is the Llama block's (``plugins.llama.sliding_window``). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from ipuft.components import FusedRows
from ipuft.errors import ConfigError, shown
from ipuft.families import HFConfigError, ModelFamily, config_float, config_int
from ipuft_llama import family as llama
from ipuft_llama.description import Description, _window, _writes

SECTION = llama.SECTION
# Phi3Config's defaults where config.json lacks the key.
DEFAULTS = {"original_max_position_embeddings": 4096, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
# transformers reads these rope types as longrope (Phi3Config.convert_rope_params_to_dict).
_LONGROPE = ("longrope", "su", "yarn")


@_writes(lambda window, types, layers: {"sliding_window": window})
def phi3_window(config: Mapping, layers: int) -> tuple[int | None, None]:
    """Phi-3: ``sliding_window`` (Phi3Config's default: none) on every layer (Phi-3-mini's 2047)."""
    return _window(config, None), None


# The Llama block as Phi-3 computes it (no biases, SwiGLU); its rope, partial rotary and fused names are read
# here, beside the description. resid_pdrop is the branches' dropout, which ipuft takes from no checkpoint.
PHI3 = Description("phi3", "Phi-3", "Phi3ForCausalLM", attention_bias="none", layer_types=phi3_window,
                   defaults={"rms_norm_eps": DEFAULTS["rms_norm_eps"]},
                   refused={"resid_pdrop": (None, 0, 0.0), "use_bidirectional_attention": (None, False)})
MODEL_TYPE = PHI3.model_type


def fused_rows(layer: int) -> tuple[FusedRows, ...]:
    """Layer ``layer``'s two fused tensors: ``qkv_proj`` = ``[q; k; v]`` and ``gate_up_proj`` = ``[gate; up]``,
    their parts under the Llama block's Hugging Face names."""
    p = f"model.layers.{layer}."
    return (FusedRows(f"{p}self_attn.qkv_proj.weight", tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")),
            FusedRows(f"{p}mlp.gate_up_proj.weight", (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")))


def _rope_parameters(config: Mapping) -> tuple[str, dict]:
    """The rope object transformers reads: a non-empty ``rope_scaling``, else ``rope_parameters``."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(key) or {}
    if not isinstance(params, dict):
        raise HFConfigError(f"{key} must be an object or null, got {shown(params)}")
    return key, params


def _factors(params: dict, key: str, name: str, pairs: int) -> list[float]:
    values = params.get(name)
    if not (isinstance(values, list) and len(values) == pairs and all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf") for v in values)):
        raise HFConfigError(f"{key}'s {name} must be a list of {pairs} positive numbers (one per rotated pair of "
                            f"partial_rotary_factor · head_dim dimensions), got {shown(values)}")
    return [float(v) for v in values]


def longrope(config: Mapping, params: dict, key: str, rotary_dim: int) -> dict[str, Any]:
    """``plugins.llama.rope_scaling`` of a longrope config.json, as transformers computes it: the top-level
    ``original_max_position_embeddings`` (default 4096) wins over the rope object's; the attention factor is
    the given one, else ``sqrt(1 + ln(factor) / ln(original))`` where ``factor`` (the given one, else
    ``max_position_embeddings / original``) exceeds 1, else 1."""
    original = config_int(config, "original_max_position_embeddings", DEFAULTS["original_max_position_embeddings"])
    positions = config_int(config, "max_position_embeddings", DEFAULTS["max_position_embeddings"])
    try:
        factor = config_float(params, "factor", positions / original, high=llama.MAX_ROPE_FACTOR)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        else:
            attention = config_float(params, "attention_factor", high=100.0)
    except HFConfigError as exc:
        raise HFConfigError(f"{key}'s {exc}") from None
    return {"rope_type": "longrope", "factor": factor, "low_freq_factor": None, "high_freq_factor": None,
            "original_max_position_embeddings": original,
            "short_factor": _factors(params, key, "short_factor", rotary_dim // 2),
            "long_factor": _factors(params, key, "long_factor", rotary_dim // 2), "attention_factor": attention}


def read_config(config: Mapping) -> dict[str, Any]:
    """A Phi-3 config.json as ipuft config keys: the Llama reading of its shapes, then the rotary (partial,
    longrope), the fused projections, and the dropouts refused."""
    key, params = _rope_parameters(config)
    theta = config_float(params if params.get("rope_theta") is not None else config, "rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", *_LONGROPE):
        raise HFConfigError(f"{key}'s rope_type {str(kind)[:40]!r}: Phi-3 runs default or longrope")
    # Phi-3 has no attention or MLP biases whatever these say; its rope is read here, not as Llama's.
    shapes = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias", "rope_scaling")}
    shapes["rope_parameters"] = {"rope_theta": theta}
    out = llama.read_config(shapes, PHI3)
    head_dim = out[f"plugins.{SECTION}.head_dim"]
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    partial = config_float({"partial_rotary_factor": partial}, "partial_rotary_factor", 1.0, high=1.0 + 1e-9)
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise HFConfigError(f"partial_rotary_factor={partial} turns {rotary_dim} of head_dim={head_dim} dimensions; "
                            f"rotary needs an even number of at least 2")
    out.update({
        "model.attention.rotary_dim": rotary_dim,
        f"plugins.{SECTION}.rope_scaling": longrope(config, params, key, rotary_dim) if kind in _LONGROPE else None,
        f"plugins.{SECTION}.fused_projections": True,
    })
    return out


def write_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as a Phi-3 config.json (the inverse of :func:`read_config`)."""
    m, options = cfg.model, cfg.plugins[SECTION]
    llama.check_options(cfg, PHI3)
    if not options.fused_projections:
        raise HFConfigError("plugins.llama.fused_projections=false: a Phi-3 checkpoint holds qkv_proj and "
                            "gate_up_proj fused")
    out = llama.write_config(cfg, PHI3)
    out.pop("rope_scaling")
    head_dim = llama.head_dim(cfg)
    partial = m.attention.rotary_dim / head_dim
    if int(head_dim * partial) != m.attention.rotary_dim:
        raise HFConfigError(f"model.attention.rotary_dim={m.attention.rotary_dim} of head_dim={head_dim} is no "
                            f"partial_rotary_factor transformers reads back")
    scaling = options.rope_scaling
    original = DEFAULTS["original_max_position_embeddings"]
    if scaling is not None:
        original = scaling.original_max_position_embeddings
        out["rope_scaling"] = {"rope_type": "longrope", "factor": scaling.factor,
                               "attention_factor": scaling.attention_factor,
                               "short_factor": list(scaling.short_factor), "long_factor": list(scaling.long_factor)}
    out.update(partial_rotary_factor=partial, original_max_position_embeddings=original, resid_pdrop=0.0,
               embd_pdrop=0.0)
    return out


def check_longrope(scaling: DictConfig, rotary_dim: int) -> None:
    """``plugins.llama.rope_scaling`` of type longrope, one line per wrong key: ``rotary_dim / 2`` finite positive
    short and long factors, a positive original context and attention factor."""
    for name in ("short_factor", "long_factor"):
        values = scaling[name]
        if values is None or len(values) != rotary_dim // 2 or not all(
                math.isfinite(v) and v > 0 for v in values):
            raise ConfigError(f"plugins.llama.rope_scaling.{name}: longrope needs {rotary_dim // 2} finite numbers "
                              f"> 0 (one per rotated pair), got {None if values is None else list(values)}")
    for name in ("original_max_position_embeddings", "attention_factor"):
        value = scaling[name]
        if value is None or not (math.isfinite(value) and value > 0):
            raise ConfigError(f"plugins.llama.rope_scaling.{name}: longrope needs a finite number > 0, got {value}")


def parameter_names(cfg: DictConfig) -> set[str]:
    """Every parameter name of a complete Phi3ForCausalLM of ``cfg``'s shapes: Llama's, q/k/v and gate/up fused."""
    names = llama.parameter_names(cfg)
    for n in range(cfg.model.layers):
        for fused in fused_rows(n):
            names = (names - set(fused.parts)) | {fused.name}
    return names


SOURCE_KEYS = {**llama.SOURCE_KEYS, "model.attention.rotary_dim": "partial_rotary_factor"}
MODEL_KEYS = (*llama.MODEL_KEYS, f"plugins.{SECTION}.fused_projections")

FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    title="Phi-3",
    architecture="Phi3ForCausalLM",
    components={"embeddings": llama.NAME, "decoder": llama.NAME, "head": llama.NAME},
    read_config=read_config,
    write_config=write_config,
    parameter_names=parameter_names,
    source_keys=SOURCE_KEYS,
    positions_key="max_position_embeddings",
    model_keys=MODEL_KEYS,
    description="Phi-3, Phi-4: the Llama block with fused qkv/gate_up, partial rotary and longrope",
)
