"""Helpers shared by the parity tests: an equivalent transformers GPT-J built from an ipuft config."""

from __future__ import annotations

import torch
from omegaconf import DictConfig


def hf_gptj(cfg: DictConfig, seed: int = 0):
    """transformers' GPTJForCausalLM with the shapes of ``cfg``, random weights (no download), eval mode."""
    from transformers import GPTJConfig, GPTJForCausalLM

    m = cfg.model
    hf_cfg = GPTJConfig(
        vocab_size=m.embedding.vocab_size, n_positions=m.sequence_length, n_embd=m.hidden_size,
        n_layer=m.layers, n_head=m.attention.heads, rotary_dim=m.attention.rotary_dim,
        n_inner=m.intermediate_size, layer_norm_epsilon=m.layer_norm_epsilon,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPTJForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mapping mistake cannot hide
        for name, p in model.named_parameters():
            if "ln" in name or "bias" in name:
                p.normal_(1.0 if name.endswith(("ln_1.weight", "ln_f.weight")) else 0.0, 0.1)
    return model
