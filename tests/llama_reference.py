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
# The families described since: heads of 16 (not hidden / heads), and what each has of its own made to matter at
# these shapes: larger weights (initializer_range) so that the soft-caps bend, a 5-token window shorter than the
# tests' 16-token rows on the sliding layers (Gemma 2's and Gemma 3's layer 0), Gemma 3's local rotary base and
# linear rope scaling on its global layer.
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 5, "initializer_range": 0.1,
         "tie_word_embeddings": True}
KINDS.update({
    "qwen3": {"rope_theta": 20000.0, "head_dim": 16},
    "olmo2": {"rope_theta": 30000.0, "head_dim": 16, "initializer_range": 0.1},
    # Soft-caps that bend: the attention scores' at 1.5, the logits' (std 1.4, up to 5.2 here) at 3.
    "gemma2": {**GEMMA, "rope_theta": 10000.0, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0},
    "gemma3_text": {**GEMMA, "rope_theta": 20000.0, "rope_local_base_freq": 100.0, "sliding_window_pattern": 2,
                    "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
})
# transformers' config and model classes of each kind.
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_model(kind: str, seed: int = 0, **extra):
    """transformers' causal LM of ``kind`` (a key of :data:`KINDS`) with :data:`SHAPE`, random weights (no
    download), every norm and bias non-trivial so that a mapping mistake cannot hide, in eval mode."""
    import transformers

    config_class, model_class = CLASSES[kind]
    config = getattr(transformers, config_class)(**{**SHAPE, **KINDS[kind], **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
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


# Gemma 2's chat template as its tokenizer_config.json has it: no system role, roles alternating from the user's,
# the assistant named "model", each turn's content trimmed.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
# Gemma 3's chat template, as its tokenizer_config.json has it in substance: a system turn is no turn of its own
# but its content and a blank line open the first user turn; then as Gemma 2's.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
# Tokenizers as real checkpoints' are, word-level with their special tokens first (ids 0-2, Gemma's 0-4), then
# w3 or w5 on to the vocabulary's end: Llama 3's post-processor puts <|begin_of_text|> first; a ChatML tokenizer (Qwen2's, SmolLM2's) adds nothing,
# though SmolLM2-Instruct names <|im_start|> its bos.
STYLES = {
    "llama3": {"specials": ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"], "bos": "<|begin_of_text|>",
               "eos": "<|end_of_text|>", "unk": "<unk>",
               "template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|> "
                           "{{ m.content }}<|eot_id|>{% endfor %}"},
    "chatml": {"specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": "<|im_start|>",
               "eos": "<|im_end|>", "unk": "<|endoftext|>",
               "template": "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"},
    # Gemma's: <pad>, <eos>, <bos>, <start_of_turn>, <end_of_turn> (its generation_config adds the last to the
    # eos ids), and Gemma 2's chat template.
    "gemma": {"specials": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "bos": "<bos>",
              "eos": "<eos>", "unk": "<pad>", "template": GEMMA_TEMPLATE},
    "gemma3": {"specials": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "bos": "<bos>",
               "eos": "<eos>", "unk": "<pad>", "template": GEMMA3_TEMPLATE},
}


def styled_tokenizer(directory: Path, style: str, vocab_size: int = 101) -> Path:
    """A tokenizer of :data:`STYLES` saved into ``directory`` as transformers saves one (tokenizer.json,
    tokenizer_config.json with its bos and eos, chat_template.jinja) and a special_tokens_map.json as older
    versions wrote: the files a checkpoint's directory holds."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = STYLES[style]
    first = len(spec["specials"])
    vocab = {**{t: i for i, t in enumerate(spec["specials"])}, **{f"w{i}": i for i in range(first, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=spec["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(spec["specials"])
    if style == "llama3":
        tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                                 special_tokens=[("<|begin_of_text|>", 1)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec["bos"], eos_token=spec["eos"],
                                      unk_token=spec["unk"], chat_template=spec["template"])
    wrapped.save_pretrained(directory)
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": spec["bos"], "eos_token": spec["eos"],
                                                                   "unk_token": spec["unk"]}))
    return directory


def save_hf(directory: Path, kind: str, seed: int = 0, tokenizer: str | None = None, **extra):
    """:func:`hf_model` saved to ``directory`` (safetensors, config.json and generation_config.json), with the
    word-level tokenizer.json of :func:`tokenizer_json`, or the tokenizer of :data:`STYLES` ``tokenizer`` names."""
    model = hf_model(kind, seed, **extra)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is None:
        tokenizer_json(directory / "tokenizer.json")
    else:
        styled_tokenizer(directory, tokenizer)
    return model, directory
