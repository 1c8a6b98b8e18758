"""Helpers shared by the Llama-family tests: small random transformers models of odd shapes (grouped-query
attention with 2 key/value heads, a vocabulary that is not a multiple of 8), saved as Hugging Face directories."""

from __future__ import annotations

from pathlib import Path

import torch

# 6 query heads of width 8 over 2 key/value heads; MLP 80 wide; 101 tokens.
SHAPE = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
         "num_key_value_heads": 2, "vocab_size": 101, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# Llama 3.1's frequency scaling, with an original context short enough that each of its three regimes
# (kept, blended, divided) covers one of the head's four frequencies.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
KINDS = {"llama": {"rope_theta": 5000.0, "rope_scaling": LLAMA3_SCALING},
         "qwen2": {"rope_theta": 20000.0},
         "mistral": {"rope_theta": 1e6, "sliding_window": 32}}


def hf_model(kind: str, seed: int = 0, **extra):
    """transformers' causal LM of ``kind`` (``llama``, ``qwen2``, ``mistral``) with :data:`SHAPE`, random weights
    (no download), every norm and bias non-trivial so that a mapping mistake cannot hide, in eval mode."""
    import transformers

    classes = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{classes}Config")(**{**SHAPE, **KINDS[kind], **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{classes}ForCausalLM")(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def tokenizer_json(path: Path, vocab_size: int = 101) -> Path:
    """A word-level tokenizer.json of ``vocab_size`` tokens: ``<unk>``, ``<s>`` (1), ``</s>`` (2), then ``w3``...:
    text is whitespace-separated words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path))
    return path


def save_hf(directory: Path, kind: str, seed: int = 0, **extra):
    """:func:`hf_model` saved to ``directory`` (safetensors and config.json, with a tokenizer.json)."""
    model = hf_model(kind, seed, **extra)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer_json(directory / "tokenizer.json")
    return model, directory
