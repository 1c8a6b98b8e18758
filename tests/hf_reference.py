"""Helpers shared by the parity tests: an equivalent transformers GPT-J built from an ipuft config."""

from __future__ import annotations

import torch
from omegaconf import DictConfig


def hf_gptj(cfg: DictConfig, seed: int = 0, **extra):
    """transformers' GPTJForCausalLM with the shapes of ``cfg``, random weights (no download), eval mode."""
    from transformers import GPTJConfig, GPTJForCausalLM

    m = cfg.model
    hf_cfg = GPTJConfig(
        vocab_size=m.embedding.vocab_size, n_positions=m.sequence_length, n_embd=m.hidden_size,
        n_layer=m.layers, n_head=m.attention.heads, rotary_dim=m.attention.rotary_dim,
        n_inner=m.intermediate_size, layer_norm_epsilon=m.layer_norm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **{"tie_word_embeddings": False, **extra},
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPTJForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mapping mistake cannot hide
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.normal_(1.0 if name.endswith(("ln_1.weight", "ln_f.weight")) else 0.0, 0.1)
    return model


def hf_units(modules, layers: int, hf_state) -> dict:
    """A Hugging Face state dict split into ipuft's units (``embeddings``, ``decoder.N``, ``head``) by each
    component's own ``hf_mapping``."""
    from ipuft.io.hf_names import unit_mappings

    return {unit: {local: hf_state[hf] for local, hf in mapping.items()}
            for unit, mapping in unit_mappings(modules, layers).items()}


def hf_state(modules, layers: int, units) -> dict:
    """ipuft's per-unit tensors under their Hugging Face names (the inverse of :func:`hf_units`)."""
    from ipuft.io.hf_names import unit_mappings

    return {hf: units[unit][local] for unit, mapping in unit_mappings(modules, layers).items()
            for local, hf in mapping.items()}


def hf_runner(cfg: DictConfig, hooks, state):
    """A layer-major inference runner (:class:`ipuft.engine.inference.LayerMajor`) over an inference engine whose
    store holds the Hugging Face state dict ``state``'s weights."""
    from ipuft.engine.inference import LayerMajor
    from ipuft.engine.model import build_model
    from ipuft.engine.stored import StoredModel

    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, cfg.model.layers, state)
    model = StoredModel(cfg, parts, torch.device("cpu"),
                        initializer=lambda unit, specs: {s.name: units[unit][s.name].to(s.dtype) for s in specs})
    return LayerMajor(model)
