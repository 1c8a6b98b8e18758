"""Model families: how a Hugging Face checkpoint of one architecture maps onto ipuft's config and components.

A family is one config.json ``model_type`` (``gptj``, ``llama``, ``mistral``, ``qwen2``): the components that
compute it, how its config.json becomes ipuft config keys (:attr:`ModelFamily.read_config`) and back
(:attr:`ModelFamily.write_config`), and the parameter names of a complete model. The plugin that ships an
architecture's components registers its families (``ipuft_register_model_families``); core never branches
on a family's name:

- ``model.hf_checkpoint=DIR`` picks the family registered for ``DIR/config.json``'s ``model_type``, which sets
  ``model.family``, the components (unless the user chose others) and the shapes;
- ``ipuft export`` writes the run's ``model.family``: its config.json, and exactly its parameter names.

The parameter names themselves stay with the components (their ``hf_mapping``); the family only says which
names make a complete model, so that an export cannot silently lack or add one.

This module imports no torch: plugins import it when they are discovered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipuft.errors import PluginError, choices, shown
from ipuft.registry import Registry

if TYPE_CHECKING:
    from omegaconf import DictConfig


class HFConfigError(ValueError):
    """What is wrong with a config.json, in one line (core adds the file's name): a family's ``read_config``
    raises it for a missing key, a value of the wrong type or range, or a feature ipuft does not run."""


@dataclass(frozen=True)
class ModelFamily:
    """One Hugging Face architecture, as ipuft reads and writes it.

    ``model_type``: config.json's ``model_type``, and the value of ``model.family`` that selects the family.
    ``title``: its name in messages (``GPT-J``).
    ``architecture``: config.json's ``architectures`` entry an export writes (``LlamaForCausalLM``).
    ``components``: the component name for each role (``embeddings``, ``decoder``, ``head``).
    ``read_config(config)``: config.json (a dict, untrusted) as ``{ipuft config key: value}``, every value
    checked; :class:`HFConfigError` for anything it cannot run.
    ``write_config(cfg)``: the family's keys of config.json for the run's config (the shapes
    ``read_config`` reads back; core adds ``architectures``, ``model_type``, the components' keys, the
    special tokens and ``torch_dtype``).
    ``parameter_names(cfg)``: every parameter name of a complete model of ``cfg``'s shapes.
    ``source_keys``: the config.json key each ipuft key ``read_config`` sets comes from, for messages.
    ``positions_key``: the config.json key of the longest sequence the model was made for, if any.
    ``component_keys``: config.json keys only a component can give (``{role: keys}``), from its
    ``hf_config()``: a substitute component that leaves one out cannot be exported.
    ``model_keys``: the ipuft config keys that make a model of the family what it is, beside ``model.family``
    and the components: its weights' shapes and what its computation reads (a rotary base, a norm's
    epsilon, a plugin's options such as ``plugins.llama.kv_heads``). A checkpoint's weights fix them, so
    ``model.init_checkpoint`` and a resumed run take them from its config (:mod:`ipuft.config.identity`).
    """

    model_type: str
    title: str
    architecture: str
    components: Mapping[str, str]
    read_config: Callable[[dict], dict[str, Any]]
    write_config: Callable[[DictConfig], dict[str, Any]]
    parameter_names: Callable[[DictConfig], set[str]]
    source_keys: Mapping[str, str] = field(default_factory=dict)
    positions_key: str | None = None
    component_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    model_keys: tuple[str, ...] = ()
    description: str = ""
    plugin: str = ""


class ModelFamilyRegistry(Registry):
    """Every model family the installed plugins registered, by ``model_type``."""

    kind = "model family"

    def __init__(self) -> None:
        super().__init__()
        self._families: dict[str, ModelFamily] = {}

    def add(self, family: ModelFamily) -> None:
        """Register ``family``; a ``model_type`` registered twice follows the duplicate rule of
        :mod:`ipuft.registry`."""
        origin = self.origin()
        if not isinstance(family, ModelFamily):
            raise PluginError(f"plugin {origin.plugin!r} registers a model family that is not an "
                              f"ipuft.families.ModelFamily: {type(family).__name__}")
        if self._claim(family.model_type, f"model family {family.model_type!r}", origin):
            self._families[family.model_type] = ModelFamily(**{**family.__dict__, "plugin": origin.plugin})

    def get(self, model_type: str, key: str = "model.family") -> ModelFamily:
        """The family of ``model_type``; a :class:`PluginError` naming ``key`` and the choices if none."""
        try:
            return self._families[model_type]
        except KeyError:
            raise PluginError(f"{key}: no installed plugin reads or writes Hugging Face model_type "
                              f"{str(model_type)[:40]!r}; installed: {choices(self._families)}") from None

    def __contains__(self, model_type: object) -> bool:
        return model_type in self._families

    def names(self) -> list[str]:
        return sorted(self._families)

    def __iter__(self) -> Iterator[ModelFamily]:
        return iter(self._families.values())


# ---- checking config.json's values, for families' read_config ----

_ABSENT = object()


def config_int(config: Mapping, key: str, default: Any = _ABSENT, *, minimum: int = 1) -> int:
    """config.json's ``key`` as an int of at least ``minimum`` (``default`` when absent or null, if given)."""
    value = config.get(key)
    if value is None:
        if default is _ABSENT:
            raise HFConfigError(f"lacks {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= 1 << 40:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer of at least {minimum}")
        raise HFConfigError(f"{key} must be {kind}, got {shown(value)}")
    return value


def config_float(config: Mapping, key: str, default: Any = _ABSENT, *, low: float = 0.0,
                 high: float = float("inf")) -> float:
    """config.json's ``key`` as a number in the open interval (``low``, ``high``)."""
    value = config.get(key)
    if value is None:
        if default is _ABSENT:
            raise HFConfigError(f"lacks {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise HFConfigError(f"{key} must be a number in ({low:g}, {high:g}), got {shown(value)}")
    return float(value)


def config_flag(config: Mapping, key: str, default: bool) -> bool:
    """config.json's ``key`` as a boolean (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"{key} must be true or false, got {shown(value)}")
    return value


# ---- every field of config.json, checked where it is read ----

def _int_at_least(minimum: int) -> Callable[[Mapping, str], Any]:
    return lambda config, key: config_int(config, key, None, minimum=minimum)


def _fraction(config: Mapping, key: str) -> Any:
    """A probability (a dropout): a number in [0, 1]."""
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise HFConfigError(f"{key} must be a number in [0, 1], got {shown(value)}")
    return value


def _positive(config: Mapping, key: str) -> Any:
    return config_float(config, key, None)


def _flag(config: Mapping, key: str) -> Any:
    return config_flag(config, key, False)


def _of_type(kind: type | tuple[type, ...], what: str) -> Callable[[Mapping, str], Any]:
    def check(config: Mapping, key: str) -> Any:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise HFConfigError(f"{key} must be {what}, got {shown(value)}")
        return value
    return check


def _text_list(config: Mapping, key: str) -> Any:
    value = config.get(key)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise HFConfigError(f"{key} must be a list of class names, got {shown(value)}")
    return value


# The fields transformers' configs of the families ipuft runs (and PretrainedConfig) give, by what each must be:
# read or not by a family, an export writes them back, so each is checked when config.json is read. Null is a
# field's "unset" for all of them; a field not listed may hold any JSON value but a non-finite number.
CONFIG_FIELDS: dict[str, Callable[[Mapping, str], Any]] = {
    **{key: _int_at_least(1) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions", "n_embd", "n_layer", "n_head",
        "n_inner", "rotary_dim", "sliding_window", "pretraining_tp", "n_ctx")},
    "max_window_layers": _int_at_least(0),
    "pad_token_id": _int_at_least(-1),  # some converted Llama configs say -1: no pad token
    **{key: _fraction for key in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                                  "mlp_dropout", "summary_first_dropout")},
    **{key: _positive for key in ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "initializer_range")},
    **{key: _flag for key in ("tie_word_embeddings", "use_cache", "attention_bias", "mlp_bias", "use_sliding_window",
                              "scale_attn_weights", "is_encoder_decoder")},
    **{key: _of_type(str, "text") for key in ("model_type", "hidden_act", "activation_function", "torch_dtype",
                                              "dtype", "transformers_version")},
    "architectures": _text_list,
    "rope_scaling": _of_type(dict, "an object"),
    "rope_parameters": _of_type(dict, "an object"),
}


def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN or infinity in a JSON value (Python's json reads them; JSON has none)."""
    if isinstance(value, float) and value - value != 0:
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _non_finite(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]")) is not None:
            return found
    return None


def check_config_fields(config: Mapping) -> None:
    """Every field of config.json (a dict, untrusted) that :data:`CONFIG_FIELDS` knows, of its type and range,
    and no NaN or infinity anywhere: :class:`HFConfigError` naming the first that is not. Core calls it wherever a
    config.json is read (an import, an export's pass-through of the source's), before any family reads it, so
    that no family (a new one included) reads, and no export writes back, a value no model could have."""
    for key, check in CONFIG_FIELDS.items():
        if key in config:
            check(config, key)
    for key, value in config.items():
        if (found := _non_finite(value, str(key))) is not None:
            raise HFConfigError(f"{found[:80]} must be a finite number, got NaN or an infinity")
