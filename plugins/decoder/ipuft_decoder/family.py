"""GPT-J as a Hugging Face family (``model_type`` ``gptj``): its config.json read into ipuft's keys and written
back, and the parameter names of a complete transformers ``GPTJForCausalLM``. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ipuft.families import HFConfigError, ModelFamily, config_flag, config_float, config_int

# config.json key → ipuft config key; each must agree with the run's config.
HF_SHAPES = {
    "n_layer": "model.layers",
    "n_embd": "model.hidden_size",
    "n_head": "model.attention.heads",
    "rotary_dim": "model.attention.rotary_dim",
    "vocab_size": "model.embedding.vocab_size",
    "n_inner": "model.intermediate_size",
    "layer_norm_epsilon": "model.layer_norm_epsilon",
}

# A decoder layer's parameter names under ``transformer.h.<n>.``, and the rest, as GPTJForCausalLM has them.
LAYER = ("ln_1.weight", "ln_1.bias", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
         "attn.out_proj.weight", "mlp.fc_in.weight", "mlp.fc_in.bias", "mlp.fc_out.weight", "mlp.fc_out.bias")
OUTER = ("transformer.wte.weight", "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight",
         "lm_head.bias")


def read_config(config: Mapping) -> dict[str, Any]:
    """A GPT-J config.json as ipuft config keys (``n_inner`` null: 4 × ``n_embd``), every value checked."""
    hidden = config_int(config, "n_embd")
    heads = config_int(config, "n_head")
    if hidden % heads:
        raise HFConfigError(f"n_head={heads} does not divide n_embd={hidden}")
    values = {
        "n_layer": config_int(config, "n_layer"),
        "n_embd": hidden,
        "n_head": heads,
        "rotary_dim": config_int(config, "rotary_dim"),
        "vocab_size": config_int(config, "vocab_size"),
        "n_inner": config_int(config, "n_inner", 4 * hidden),
        "layer_norm_epsilon": config_float(config, "layer_norm_epsilon", 1e-5, high=1.0),
    }
    return {**{HF_SHAPES[key]: value for key, value in values.items()},
            "model.tie_embeddings": config_flag(config, "tie_word_embeddings", False)}


def write_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's config as a transformers GPTJConfig's keys: the shapes :func:`read_config` reads back, and
    GPT-J's fixed settings."""
    return {
        **{hf: OmegaConf.select(cfg, key) for hf, key in HF_SHAPES.items()},
        "n_positions": max(cfg.model.sequence_length, 2048),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(cfg.model.tie_embeddings),
    }


def parameter_names(cfg: DictConfig) -> set[str]:
    """Every parameter name of a complete transformers GPT-J of ``cfg``'s layers."""
    outer = {*OUTER} - ({"lm_head.weight"} if cfg.model.tie_embeddings else set())  # tied: the embeddings' table
    return {*outer, *(f"transformer.h.{n}.{name}" for n in range(cfg.model.layers) for name in LAYER)}


GPTJ = ModelFamily(
    model_type="gptj",
    title="GPT-J",
    architecture="GPTJForCausalLM",
    components={"embeddings": "gptj", "decoder": "gptj", "head": "gptj"},
    read_config=read_config,
    write_config=write_config,
    parameter_names=parameter_names,
    source_keys={**{key: hf for hf, key in HF_SHAPES.items()}, "model.tie_embeddings": "tie_word_embeddings"},
    positions_key="n_positions",
    component_keys={"decoder": ("activation_function",)},
    model_keys=(*HF_SHAPES.values(), "model.attention.rotary_positional_embeddings_base"),
    description="GPT-J: parallel attention and MLP, interleaved rotary, gelu_new",
)
