"""A decoder family of the Llama architecture, described as data: :class:`Description`.

Every family this plugin reads (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Gemma 2, Gemma 3) is one block with the
same parts (RMSNorm, rotate-half rotary, grouped-query attention, a gated MLP) that differ in where the norms
sit, how a norm applies its gain, whether q and k are normed, the activation, the biases, the attention's
scale and soft-caps, the embeddings' scale, and which layers attend within a sliding window. A
:class:`Description` says each of these for one Hugging Face ``model_type``, and which config.json keys set
them; :func:`ipuft_llama.family.family` makes the :class:`ipuft.families.ModelFamily` that reads and writes
config.json from it, and the block (:mod:`ipuft_llama.modules`) runs whatever the run's ``plugins.llama``
options, set from that config.json, say. Adding a family is a description (docs/models.md).

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ipuft.errors import shown
from ipuft.families import HFConfigError, config_flag, config_int

PLACEMENTS = ("pre", "sandwich", "post")
QK_NORMS = ("head", "width")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL, SLIDING = "full_attention", "sliding_attention"
# Each placement's norms in a layer, by the names transformers gives them (so they are the block's attributes
# and its weights' names): before attention, after it, before the MLP, after it (None: no norm there).
NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


def _frozen(mapping: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


# ---- how each family's config.json says which layers attend within the window ----
# A rule reads config.json and the layer count as the window (None: none) and each layer's type (None: every
# layer the window's, or every layer full without one); its ``write`` gives the keys that say them back.

LayerTypes = Callable[[Mapping, int], tuple["int | None", "list[str] | None"]]


def _writes(write: Callable[[int | None, list[str] | None, int], dict]) -> Callable[[LayerTypes], LayerTypes]:
    def attach(rule: LayerTypes) -> LayerTypes:
        rule.write = write  # type: ignore[attr-defined]
        return rule

    return attach


def _window(config: Mapping, default: int | None) -> int | None:
    value = config.get("sliding_window", default) if "sliding_window" in config else default
    return None if value is None else config_int({"sliding_window": value}, "sliding_window")


def _explicit(config: Mapping, layers: int) -> list[str] | None:
    """config.json's own ``layer_types`` (transformers 5 writes it), checked; None when absent."""
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
        raise HFConfigError(f"layer_types must be a list of {layers} entries, each {FULL!r} or {SLIDING!r}, got "
                            f"{shown(types)}")
    return list(types)


@_writes(lambda window, types, layers: {})
def no_windows(config: Mapping, layers: int) -> tuple[int | None, list[str] | None]:
    """Llama: every layer attends over the whole causal past."""
    return None, None


@_writes(lambda window, types, layers: {"sliding_window": window})
def every_layer_windowed(config: Mapping, layers: int) -> tuple[int | None, list[str] | None]:
    """Mistral: ``sliding_window`` (default 4096, null: none) on every layer."""
    return _window(config, 4096), None


def _write_qwen(window: int | None, types: list[str] | None, layers: int) -> dict:
    if window is None:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    types = types or [SLIDING] * layers
    first = types.index(SLIDING) if SLIDING in types else layers
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": first, "layer_types": types}


@_writes(_write_qwen)
def qwen_layer_types(config: Mapping, layers: int) -> tuple[int | None, list[str] | None]:
    """Qwen2, Qwen3: with ``use_sliding_window``, ``sliding_window`` on the layers ``layer_types`` names, else
    on layers from ``max_window_layers`` (default 28) on; without it, none (whatever ``layer_types`` says)."""
    if not config_flag(config, "use_sliding_window", False):
        return None, None
    window = _window(config, 4096)
    if window is None:
        return None, None
    types = _explicit(config, layers)
    if types is None:
        first = config_int(config, "max_window_layers", 28, minimum=0)
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    return window, types


def alternating(pattern_key: str | None, pattern: int) -> LayerTypes:
    """Gemma 2 (every second layer global) and Gemma 3 (``sliding_window_pattern``, default 6: five local
    layers, then a global one): ``layer_types`` where config.json gives it, else layer ``i`` is global when
    ``(i + 1) % pattern == 0``; ``sliding_window`` (default 4096) on the local ones."""

    def rule(config: Mapping, layers: int) -> tuple[int | None, list[str] | None]:
        window = _window(config, 4096)
        types = _explicit(config, layers)
        if types is None:
            every = config_int(config, pattern_key, pattern) if pattern_key else pattern
            types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)]
        return window, (types if window is not None else None)

    rule.__doc__ = alternating.__doc__
    return _writes(lambda window, types, layers: {"sliding_window": window, "layer_types": types or [FULL] * layers})(
        rule)


@dataclass(frozen=True)
class Description:
    """One Hugging Face family of the Llama architecture: its arithmetic and its config.json.

    ``model_type``, ``title``, ``architecture``: config.json's model_type, the name in messages, and the
    ``architectures`` entry an export writes.

    The block (each is a ``plugins.llama`` option the family sets; the defaults are Llama's):
    ``norms``: where the RMSNorms sit (:data:`NORMS`): ``pre`` (Llama: before attention and before the MLP),
    ``sandwich`` (Gemma 2/3: before and after each), ``post`` (OLMo 2: after each, none before).
    ``norm_offset``: the gain is ``1 + w`` (Gemma) instead of ``w``.
    ``norm_gain_float32``: the gain multiplies the float32 normed value, then the product is rounded to the
    activations' dtype (OLMo 2, Gemma); otherwise the normed value is rounded first (Llama, Qwen).
    ``qk_norm``: an RMSNorm on q and k before rotary, over each head (``head``: Qwen3, Gemma 3) or over the whole
    projected width (``width``: OLMo 2); None: none.
    ``embedding_scale``: the embeddings are multiplied by sqrt(hidden), that factor rounded to the model's dtype
    (Gemma).

    config.json:
    ``activation_key``: the key of the MLP's activation, ``activations``: those the family takes (of
    :data:`ACTIVATIONS`).
    ``attention_bias``: ``key`` (config.json's ``attention_bias`` puts biases on q, k, v and o), ``qkv`` (q, k
    and v always have biases, o never: Qwen2) or ``none``.
    ``mlp_bias``: config.json's ``mlp_bias`` puts biases on gate, up and down (Llama).
    ``query_pre_attn_scalar``: the softmax scale is ``query_pre_attn_scalar ** -0.5`` (Gemma).
    ``attn_softcap``, ``final_softcap``: config.json's ``attn_logit_softcapping`` and ``final_logit_softcapping``
    cap the attention scores and the logits (Gemma 2; Gemma 3 the logits only, as transformers does).
    ``layer_types``: the rule that reads the window and each layer's type (:func:`qwen_layer_types`, ...).
    ``local_rope``: sliding layers have a rotary of their own (Gemma 3's ``rope_local_base_freq``, or
    ``rope_parameters.sliding_attention``), and a rope scaling applies to the global layers only.
    ``defaults``: transformers' config class defaults of keys config.json may lack (``num_key_value_heads``,
    ``head_dim``, ``rope_theta``, ``tie_word_embeddings``, ...).
    ``written``: fixed keys an export of a model from scratch writes (``query_pre_attn_scalar``, ...), beside
    those the options give.
    ``refused``: config.json keys and the only values ipuft runs (anything else is one line naming it).
    """

    model_type: str
    title: str
    architecture: str
    norms: str = "pre"
    norm_offset: bool = False
    norm_gain_float32: bool = False
    qk_norm: str | None = None
    embedding_scale: bool = False
    activation_key: str = "hidden_act"
    activations: tuple[str, ...] = ("silu",)
    attention_bias: str = "key"
    mlp_bias: bool = False
    query_pre_attn_scalar: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    layer_types: LayerTypes = no_windows
    local_rope: bool = False
    defaults: Mapping[str, Any] = field(default_factory=_frozen)
    written: Mapping[str, Any] = field(default_factory=_frozen)
    refused: Mapping[str, tuple] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        if self.norms not in PLACEMENTS:
            raise ValueError(f"{self.model_type}: norms={self.norms!r}, one of {', '.join(PLACEMENTS)}")
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"{self.model_type}: qk_norm={self.qk_norm!r}, one of None, {', '.join(QK_NORMS)}")
        if self.attention_bias not in ("key", "qkv", "none"):
            raise ValueError(f"{self.model_type}: attention_bias={self.attention_bias!r}, one of key, qkv, none")
        if not self.activations or any(a not in ACTIVATIONS for a in self.activations):
            raise ValueError(f"{self.model_type}: activations {self.activations} must be among {ACTIVATIONS}")
        for name in ("defaults", "written", "refused"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def block_options(self) -> dict[str, Any]:
        """The ``plugins.llama`` options the description fixes for every checkpoint of the family."""
        return {"norms": self.norms, "norm_offset": self.norm_offset, "norm_gain_float32": self.norm_gain_float32,
                "qk_norm": self.qk_norm, "embedding_scale": self.embedding_scale}


# Keys whose other values change the arithmetic in ways no family here runs (checked for every family).
_COMMON_REFUSED = {"partial_rotary_factor": (None, 1, 1.0), "use_bidirectional_attention": (None, False)}

LLAMA = Description("llama", "Llama", "LlamaForCausalLM", mlp_bias=True, refused=_COMMON_REFUSED)
MISTRAL = Description("mistral", "Mistral", "MistralForCausalLM", attention_bias="none",
                      layer_types=every_layer_windowed, defaults={"num_key_value_heads": 8},
                      refused=_COMMON_REFUSED)
QWEN2 = Description("qwen2", "Qwen2", "Qwen2ForCausalLM", attention_bias="qkv", layer_types=qwen_layer_types,
                    defaults={"num_key_value_heads": 32}, refused=_COMMON_REFUSED)
QWEN3 = Description("qwen3", "Qwen3", "Qwen3ForCausalLM", qk_norm="head", layer_types=qwen_layer_types,
                    defaults={"num_key_value_heads": 32, "head_dim": 128}, refused=_COMMON_REFUSED)
OLMO2 = Description("olmo2", "OLMo 2", "Olmo2ForCausalLM", norms="post", norm_gain_float32=True, qk_norm="width",
                    defaults={"rms_norm_eps": 1e-5}, refused=_COMMON_REFUSED)
_GEMMA = {"norms": "sandwich", "norm_offset": True, "norm_gain_float32": True, "embedding_scale": True,
          "activation_key": "hidden_activation", "activations": ("gelu_pytorch_tanh",),
          "query_pre_attn_scalar": True, "final_softcap": True, "refused": _COMMON_REFUSED}
GEMMA2 = Description("gemma2", "Gemma 2", "Gemma2ForCausalLM", **_GEMMA, attn_softcap=True,
                     layer_types=alternating(None, 2),
                     defaults={"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
                               "query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0,
                               "attn_logit_softcapping": 50.0})
GEMMA3 = Description("gemma3_text", "Gemma 3", "Gemma3ForCausalLM", **_GEMMA, qk_norm="head",
                     layer_types=alternating("sliding_window_pattern", 6), local_rope=True,
                     defaults={"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
                               "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0,
                               "rope_local_base_freq": 10_000.0})

# Every description here, by model_type.
BY_TYPE = {d.model_type: d for d in (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2, GEMMA2, GEMMA3)}
# The families this plugin registers.
DESCRIPTIONS = tuple(BY_TYPE.values())
