"""Every rule a run's config must satisfy beyond each key's type, in one place.

- :func:`derive_and_validate`: the derived values (as the reference derives them) and the cross-key checks.
  :func:`ipuft.config.load_config` runs it, so every config goes through it: presets, overrides, a
  checkpoint's config, a Hugging Face directory's shapes.
- :func:`check_plugins`: what the installed plugins make of the config: the components, the optimizer and the
  logging backends it names are registered, and an optimizer that needs whole tensors is not sharded by RTS.

What the built components make of the config (something is trainable, each optimizer-state variable can follow its
variable's tensor-parallel layout) is :func:`ipuft.engine.model.check_model`, beside the model it checks.
:func:`ipuft.engine.model.build_model` runs it and :func:`check_plugins` (the optimizer rule with the optimizer,
when a run trains or plans training), so every command goes through all of them whether it comes from the CLI or
from Python: train, bench, plan, eval, generate, export. The CLI runs :func:`check_plugins` for ``config show``
too, which builds no model. Each failure is one :class:`~ipuft.errors.ConfigError` (or
:class:`~ipuft.errors.PluginError`) line naming the key.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft.config.schema import OptimizerPlacement, Precision
from ipuft.errors import ConfigError

if TYPE_CHECKING:
    from ipuft.plugins import Registrations

_POSITIVE = (
    "model.layers", "model.hidden_size", "model.sequence_length", "model.embedding.vocab_size",
    "model.attention.heads", "model.attention.rotary_dim", "training.global_batch_size",
    "execution.micro_batch_size", "execution.data_parallel", "execution.tensor_parallel",
    "checkpoint.to_keep",
)  # fmt: skip
_NON_NEGATIVE = (
    "training.steps", "training.eval_steps", "training.optimizer.learning_rate.maximum", "checkpoint.steps",
    "execution.update_piece_bytes", "execution.head_chunk_tokens", "execution.head_vocab_slices",
)  # fmt: skip
# Finite and > 0: a zero or an infinity here makes every step NaN or a no-op.
_POSITIVE_FINITE = (
    "model.layer_norm_epsilon", "model.attention.rotary_positional_embeddings_base",
    "training.optimizer.gradient_clipping", "execution.loss_scaling_initial", "execution.collective_timeout_s",
)  # fmt: skip
# Upper bounds far above any real run, so that absurd sizes are one line, not a plan that never ends.
_AT_MOST = {
    "model.layers": 1 << 12, "model.hidden_size": 1 << 18, "model.intermediate_size": 1 << 20,
    "model.sequence_length": 1 << 20, "model.embedding.vocab_size": 1 << 24, "model.attention.heads": 1 << 12,
    "training.steps": 1 << 40, "training.global_batch_size": 1 << 24, "execution.micro_batch_size": 1 << 16,
    "execution.data_parallel": 1 << 16, "execution.tensor_parallel": 1 << 12, "checkpoint.to_keep": 1 << 20,
    "checkpoint.steps": 1 << 40, "training.max_consecutive_skips": 1 << 40,
    "training.eval_steps": 1 << 40,
    "execution.loss_scaling_growth_interval": 1 << 40,
    "execution.update_piece_bytes": 1 << 50, "execution.head_chunk_tokens": 1 << 30,
    "execution.head_vocab_slices": 1 << 20,
}  # fmt: skip


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def derived_gradient_accumulation(cfg: DictConfig) -> int | None:
    """``training.global_batch_size / (execution.data_parallel × execution.micro_batch_size)``, or None when
    that is not a whole number."""
    replicas = cfg.execution.data_parallel * cfg.execution.micro_batch_size
    batch = cfg.training.global_batch_size
    return batch // replicas if batch % replicas == 0 else None


def derive_and_validate(cfg: DictConfig) -> None:
    """Fill the derived values of ``cfg`` in place and check its cross-key constraints."""
    for key in _POSITIVE:
        _require(_get(cfg, key) > 0, key, f"must be > 0, got {_get(cfg, key)}")
    for key in _NON_NEGATIVE:
        _require(_get(cfg, key) >= 0, key, f"must be >= 0, got {_get(cfg, key)}")
    for key in (*_NON_NEGATIVE, *_POSITIVE_FINITE):
        _require(math.isfinite(_get(cfg, key)), key, f"must be finite, got {_get(cfg, key)}")
    for key in _POSITIVE_FINITE:
        _require(_get(cfg, key) > 0, key, f"must be > 0, got {_get(cfg, key)}")
    for key, limit in _AT_MOST.items():
        value = _get(cfg, key)
        _require(value is None or value <= limit, key, f"{value} is beyond any real run (at most {limit})")

    model, execution, optim = cfg.model, cfg.execution, cfg.training.optimizer
    roles = ("embeddings", "decoder", "head")
    for role in model.freeze:
        _require(role in roles, "model.freeze", f"{role!r} is not a role; roles: {', '.join(roles)}")
    _require(0.0 <= model.dropout_prob < 1.0, "model.dropout_prob", f"must be in [0, 1), got {model.dropout_prob}")
    if model.init_checkpoint is not None:
        _require(model.hf_checkpoint is None, "model.init_checkpoint",
                 "and model.hf_checkpoint both name the initial weights; give one of them")
        _require(cfg.checkpoint.load is None, "model.init_checkpoint",
                 "starts a new run from a checkpoint's weights and checkpoint.load resumes one; give one of them")
    training = cfg.training
    data = cfg.data
    _require(data.template_max_chars >= 1, "data.template_max_chars",
             f"must be a positive number of characters, got {data.template_max_chars}")
    _require(0 < data.template_seconds <= 3600, "data.template_seconds",
             f"must be in (0, 3600] seconds, got {data.template_seconds}")
    _require(0.0 <= data.validation_fraction < 1.0, "data.validation_fraction",
             f"must be in [0, 1), got {data.validation_fraction}")
    _require(not (data.validation_fraction and data.validation_path is not None), "data.validation_fraction",
             "and data.validation_path both name the validation rows; give one of them")
    _require(not data.validation_fraction or data.path is not None, "data.validation_fraction",
             "holds out rows of data.path, which is not set (synthetic data has no rows)")
    for key in ("text_field", "prompt_field", "response_field", "messages_field", "input_field"):
        named = isinstance(data[key], str) and data[key].strip() != ""
        _require(named or (data[key] is None and key == "input_field"), f"data.{key}",
                 f"must name a field of the rows, got {data[key]!r}")
    _require(data.prompt_field != data.response_field, "data.response_field",
             f"and data.prompt_field are both {data.prompt_field!r}; the prompt and the response are two fields")
    _require(data.whole_examples is not True or data.packing, "data.whole_examples",
             "packs examples whole into rows, but data.packing=false keeps one example per row; set "
             "data.packing=true or drop it")
    _require(data.max_prompt_tokens is None or data.max_prompt_tokens >= 1, "data.max_prompt_tokens",
             f"must be null or a number of tokens >= 1, got {data.max_prompt_tokens}")
    if str(getattr(data.format, "value", data.format)) == "preference":
        mbs = execution.micro_batch_size  # (so training.global_batch_size, a multiple of it, is even too)
        _require(mbs % 2 == 0, "execution.micro_batch_size", f"is {mbs}, but data.format=preference counts rows, "
                 "two a pair (prompt + chosen, prompt + rejected, in one micro-batch); set an even number")
        pref = training.preference
        _require(0 < pref.beta < math.inf, "training.preference.beta", f"must be a finite number > 0, got {pref.beta}")
        _require(0 <= pref.sft_weight < math.inf, "training.preference.sft_weight",
                 f"must be a finite number >= 0, got {pref.sft_weight}")
        _require(math.isfinite(pref.simpo_gamma), "training.preference.simpo_gamma",
                 f"must be a finite number, got {pref.simpo_gamma}")
    named = [k for k in ("validation_path", "validation_split") if data[k] is not None] + \
        (["validation_fraction"] if data.validation_fraction else [])
    _require(len(named) <= 1, f"data.{named[0] if named else 'validation_path'}",
             f"and data.{named[-1] if named else ''} both name the validation rows; give one of them")
    _require(data.validation_split is None or data.path is not None, "data.validation_split",
             "is a split of data.path's dataset, and data.path is null")
    _require(not training.eval_steps or named,
             "training.eval_steps", "evaluates on data.validation_path, data.validation_split or "
             "data.validation_fraction; set one of "
             "them (or eval_steps=0)")
    _require(not (training.stochastic_rounding and training.master_weights), "training.stochastic_rounding",
             "and training.master_weights are two ways to update 16-bit weights; set at most one of them")
    for recipe in ("stochastic_rounding", "master_weights"):
        _require(not training[recipe] or model.precision != Precision.float32, f"training.{recipe}",
                 "applies to 16-bit weights, but model.precision is float32; set model.precision=bfloat16 or "
                 "float16, or drop it")
    scaling = execution.loss_scaling
    _require(scaling == "dynamic" or (isinstance(scaling, (int, float)) and not isinstance(scaling, bool)
                                      and 0 < scaling < math.inf), "execution.loss_scaling",
             f"must be a finite number > 0 or 'dynamic', got {scaling!r}")
    for key in ("offload", "recompute"):  # auto: the run's plan chooses (ipuft.run.layout)
        value = execution[key]
        if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
            value = execution[key] = {"auto": "auto", "true": True, "false": False}[value.lower()]
        _require(isinstance(value, bool) or value == "auto", f"execution.{key}",
                 f"must be true, false or auto, got {value!r}")
    _require(execution.optimizer_placement != OptimizerPlacement.host or execution.offload is not False,
             "execution.optimizer_placement", "host updates the variables where execution.offload=true keeps them, in "
             "host memory; with offload=false they live on the device and the optimizer runs there: set "
             "execution.offload=true or optimizer_placement=device")
    _activation_placement(execution)
    _require(execution.loss_scaling_initial > 0, "execution.loss_scaling_initial", "must be > 0")
    _require(execution.loss_scaling_growth_interval > 0, "execution.loss_scaling_growth_interval", "must be > 0")
    _require(cfg.training.max_consecutive_skips > 0, "training.max_consecutive_skips", "must be > 0")
    epochs = cfg.training.epochs
    _require(epochs is None or (math.isfinite(epochs) and 0 < epochs <= 1 << 20), "training.epochs",
             f"must be a number of passes over the data above 0 and at most {1 << 20} (null: training.steps), got "
             f"{epochs}")
    _require(epochs is None or cfg.data.path is not None, "training.epochs",
             "counts passes over data.path's rows, and the built-in sample data (data.path=null) has no end; set "
             "data.path, or training.steps instead")
    _require(0.0 <= optim.learning_rate.warmup_proportion <= 1.0, "training.optimizer.learning_rate.warmup_proportion",
             f"must be in [0, 1], got {optim.learning_rate.warmup_proportion}")
    _require(optim.gradient_clipping > 0, "training.optimizer.gradient_clipping",
             f"must be > 0, got {optim.gradient_clipping}")

    if model.intermediate_size is None:
        model.intermediate_size = 4 * model.hidden_size
    _require(model.intermediate_size > 0, "model.intermediate_size", f"must be > 0, got {model.intermediate_size}")
    # How wide a head is, and so how much of it rotates, is the decoder's to say (GPT-J's is hidden / heads,
    # Llama's may be plugins.llama.head_dim): each decoder checks it when built. Every rotary turns pairs.
    heads = model.attention.heads
    rotary = model.attention.rotary_dim
    _require(rotary % 2 == 0, "model.attention.rotary_dim",
             f"must be even (rotary embeddings turn pairs of dimensions), got {rotary}")
    _check_token_ids(model)

    tp = execution.tensor_parallel
    for key, value in (("model.attention.heads", heads), ("model.hidden_size", model.hidden_size),
                       ("model.intermediate_size", model.intermediate_size)):
        _require(value % tp == 0, key, f"{value} is not divisible by execution.tensor_parallel={tp}")

    ga = derived_gradient_accumulation(cfg)
    _require(ga is not None, "training.global_batch_size",
             f"{cfg.training.global_batch_size} is not divisible by execution.data_parallel × "
             f"execution.micro_batch_size = {execution.data_parallel} × {execution.micro_batch_size} = "
             f"{execution.data_parallel * execution.micro_batch_size}")
    _require(cfg.gradient_accumulation is None, "gradient_accumulation",
             f"is derived as training.global_batch_size / (execution.data_parallel × execution.micro_batch_size) "
             f"= {ga} here, not {cfg.gradient_accumulation}; set those instead")
    cfg.gradient_accumulation = ga
    _require(execution.head_vocab_slices <= 1 or execution.head_chunk_tokens > 0, "execution.head_vocab_slices",
             f"{execution.head_vocab_slices} slices the head's gradient of a loss computed by chunks of tokens; "
             f"set execution.head_chunk_tokens above 0 with it (or head_vocab_slices=0)")
    if execution.rts is None:
        execution.rts = execution.data_parallel > 1 and execution.recompute is not False
    if execution.recompute is False:
        # A kept graph references the weights and inputs its forward computed with, on the device: offloading
        # them (or gathering RTS shards per phase) would pin every layer's copy there until its backward.
        for key in ("offload", "activation_offload", "rts"):
            _require(execution[key] in (False, "auto"), "execution.recompute",
                     f"false keeps every layer's autograd graph, and the weights it references, on the device; "
                     f"set execution.{key}=false with it (or recompute=true)")


# The names activation_offload also takes for its two boolean values.
ACTIVATION_NAMES = {"none": False, "false": False, "host": True, "true": True, "disk": "disk"}


def _activation_placement(execution: DictConfig) -> None:
    """``execution.activation_offload`` is false, true or disk (its names ``none`` and ``host`` become false and
    true), and ``execution.spill_dir`` is set only where activations are spilled to disk."""
    value = execution.activation_offload
    if isinstance(value, str) and value.lower() in ACTIVATION_NAMES:
        value = execution.activation_offload = ACTIVATION_NAMES[value.lower()]
    _require(isinstance(value, bool) or value == "disk", "execution.activation_offload",
             f"must be false (on the device), true (host memory) or disk, got {value!r}")
    _require(execution.spill_dir is None or value == "disk", "execution.spill_dir",
             f"is where activation_offload=disk spills activations, but activation_offload is "
             f"{str(value).lower()}; set execution.activation_offload=disk or drop spill_dir")
    _require(execution.spill_dir is None or str(execution.spill_dir).strip() != "", "execution.spill_dir",
             "is empty; give a directory (or null: the run directory's spill/)")


def _check_token_ids(model: DictConfig) -> None:
    """``model.bos_token_id`` and each of ``model.eos_token_ids`` name a token of the vocabulary."""
    vocab = model.embedding.vocab_size
    ids = [("model.bos_token_id", model.bos_token_id)] if model.bos_token_id is not None else []
    ids += [("model.eos_token_ids", i) for i in model.eos_token_ids]
    for key, token in ids:
        _require(0 <= token < vocab, key, f"token id {token} is outside the vocabulary (0 to {vocab - 1}: "
                                          f"model.embedding.vocab_size={vocab})")
    _require(len(model.eos_token_ids) <= 64, "model.eos_token_ids",
             f"{len(model.eos_token_ids)} ids; a model has a few (at most 64)")


def check_plugins(cfg: DictConfig, registrations: Registrations) -> None:
    """The components, the model family, the optimizer and the logging backends ``cfg`` names are registered,
    and an optimizer that needs whole tensors is not given RTS shards."""
    from ipuft.components import ROLES
    from ipuft.loggers import JSONL

    for role in ROLES:
        registrations.components.get(role, cfg.model[role])
    registrations.families.get(cfg.model.family)
    name = cfg.training.optimizer.name
    registrations.optimizers.get(name)
    if cfg.execution.rts and not registrations.optimizers.elementwise(name):
        raise ConfigError(f"training.optimizer.name: {name} is not elementwise (it needs whole tensors), but "
                          f"execution.rts shards each variable over the data-parallel ranks; set execution.rts=false")
    for backend in cfg.logging.backends:
        if backend != JSONL:
            registrations.loggers.get(backend)


