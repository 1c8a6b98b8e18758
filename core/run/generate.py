"""``ipuft generate``: continue prompts with a model from an ipuft checkpoint or a Hugging Face directory, in
one process, through an inference engine and the batched decoding of :mod:`ipuft.generate`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from omegaconf import DictConfig

from ipuft.config import checkpoint_config, load_config
from ipuft.data.tokenizer import EOS, TOKENIZER_LIMIT, check_in_vocabulary, load_tokenizer, tokenizer_from_bytes
from ipuft.engine.generation import generate
from ipuft.engine.inference import LayerMajor
from ipuft.errors import ConfigError, DataError
from ipuft.io.checkpoint import read_verified
from ipuft.plugins import PluginHooks
from ipuft.run.evaluate import Measured, batches
from ipuft.run.runtime import inference_engine


def inference_config(path: str, hooks: PluginHooks, overrides: tuple[str, ...] | list[str] = ()) -> DictConfig:
    """The config of a model to run in one process: an ipuft checkpoint's (or a run directory's latest),
    or a Hugging Face directory's shapes; then ``overrides`` (``KEY=VALUE``)."""
    sections = hooks.registrations.config_sections
    single = ["execution.data_parallel=1", "execution.tensor_parallel=1", "training.global_batch_size=1",
              "execution.micro_batch_size=1"]
    if (Path(path) / "config.json").exists():
        return load_config(None, [f"model.hf_checkpoint={path}", *single, *overrides], sections)
    return checkpoint_config(path, sections, [*single, *overrides])


def tokenizer_for(cfg: DictConfig):
    """The tokenizer saved with the model ``cfg`` loads (in its checkpoint, checked against the manifest, or
    in its Hugging Face directory), else ``data.tokenizer``."""
    home = Path(cfg.checkpoint.load or cfg.model.hf_checkpoint)
    path = home / "tokenizer.json"
    if path.exists() and cfg.checkpoint.load is not None:
        return tokenizer_from_bytes(read_verified(home, "tokenizer.json", TOKENIZER_LIMIT), path)
    if path.exists():
        return load_tokenizer(str(path))
    if cfg.data.tokenizer is not None:
        return load_tokenizer(cfg.data.tokenizer)
    raise DataError(f"{home} holds no tokenizer.json; set data.tokenizer=DIR")


# Sampling's bounds. A temperature below MIN_TEMPERATURE divides logits towards float32's overflow (and is
# greedy decoding in all but name: 0 asks for that); above MAX_TEMPERATURE every token is as likely.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
SEED_LIMIT = 1 << 64  # torch seeds are unsigned 64-bit integers


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int = 0) -> None:
    """generate's options, one :class:`~ipuft.errors.ConfigError` line naming the one out of range: every number
    finite; temperature 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]; top_p in (0, 1]; top_k and
    max_new_tokens whole numbers (top_k 0: off); a seed in [0, 2**64)."""
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not (_number(temperature) and (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
        raise ConfigError(f"temperature: must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                          f"{MAX_TEMPERATURE:g}], got {temperature}")
    if not (_number(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"top_p: must be a number in (0, 1] (1: off), got {top_p}")
    if not (whole(top_k) and 0 <= top_k <= 1 << 24):
        raise ConfigError(f"top_k: must be a whole number from 0 (off) to {1 << 24}, got {top_k}")
    if not (whole(seed) and 0 <= seed < SEED_LIMIT):
        raise ConfigError(f"seed: must be a whole number in [0, 2**64), got {str(seed)[:40]}")
    if not (whole(max_new_tokens) and max_new_tokens > 0):
        raise ConfigError(f"max_new_tokens: must be a whole number > 0, got {max_new_tokens}")


def chat_stops(cfg: DictConfig, tokenizer, home: Path) -> list[int]:
    """The ids a chat reply ends at, besides ``model.eos_token_ids``: the template's end of turn as the tokenizer
    names it (tokenizer_config.json's ``eos_token``: ``<|im_end|>``, ``<|eot_id|>``) and generation_config.json's
    ``eos_token_id`` (an id or a list of them), where ``home`` has them."""
    from ipuft.io.model_files import home_files

    found = home_files(home, ("tokenizer_config.json", "generation_config.json"), f"{home}: ") if home.is_dir() else {}
    ids: list[int] = []
    if "tokenizer_config.json" in found:
        name = json.loads(found["tokenizer_config.json"]).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and tokenizer.token_to_id(name) is not None:
            ids.append(tokenizer.token_to_id(name))
    if "generation_config.json" in found:
        eos = json.loads(found["generation_config.json"]).get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and not isinstance(token, bool):
                ids.append(token)
    return ids


def chat_prompts(cfg: DictConfig, tokenizer, conversations: list) -> list[list[int]]:
    """Each of ``conversations`` (a user message's text, or a list of ``{role, content}`` messages) rendered by the
    model's chat template (``data.chat_template``, else the checkpoint's) with the generation prompt, and encoded
    as transformers encodes a rendered chat (nothing added: the template writes its own bos)."""
    from ipuft.data.bounds import RenderBounds
    from ipuft.data.chat import check_messages, load_chat_template

    home = Path(cfg.checkpoint.load or cfg.model.hf_checkpoint)
    if not (home / "tokenizer.json").exists() and cfg.data.tokenizer is not None and Path(cfg.data.tokenizer).is_dir():
        home = Path(cfg.data.tokenizer)
    template = load_chat_template(cfg.data.chat_template, home, "--checkpoint", "generate --chat",
                                  RenderBounds.of(cfg.data))
    encoded = []
    for number, conversation in enumerate(conversations, start=1):
        where = f"prompt {number}"
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
        text, _ = template.render(check_messages(messages, where), True, where)
        encoded.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return encoded


def generate_texts(cfg: DictConfig, hooks: PluginHooks, prompts: list, max_new_tokens: int,
                   batch_size: int = 8, chat: bool = False, **sampling) -> dict:
    """Continue each prompt, ``batch_size`` prompts decoded together; ``{"completions", "new_tokens",
    "tokens_per_s" (new tokens per second), "device_peak_bytes"}``. ``sampling``: temperature, top_k, top_p,
    seed (see :func:`ipuft.engine.generation.generate`). Each prompt is encoded as the tokenizer encodes a text, with
    what its post-processor adds (Llama 3's <|begin_of_text|>; nothing for a tokenizer that adds nothing), as
    training data is; a row stops at any of ``model.eos_token_ids``, else at the tokenizer's <|endoftext|>.

    With ``chat``, each prompt is a conversation (:func:`chat_prompts`), rendered with the generation prompt; a
    row also stops at the end of its turn (:func:`chat_stops`), and its completion is the reply alone, without
    the special tokens that end it."""
    check_sampling(max_new_tokens, **sampling)
    tokenizer = tokenizer_for(cfg)
    vocab, positions = cfg.model.embedding.vocab_size, cfg.model.sequence_length
    if chat:
        encoded = chat_prompts(cfg, tokenizer, prompts)
    else:
        encodings = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        for number, encoding in enumerate(encodings, start=1):
            if all(s is None for s in encoding.sequence_ids):  # nothing of the prompt's own, only added tokens
                raise DataError(f"prompt {number} is empty after tokenization")
        encoded = [encoding.ids for encoding in encodings]
    for number, ids in enumerate(encoded, start=1):
        if not ids:
            raise DataError(f"prompt {number} is empty after tokenization")
        check_in_vocabulary(ids, vocab, f"prompt {number}")
        if len(ids) + max_new_tokens > positions:
            raise DataError(f"prompt {number}: its {len(ids)} tokens and max_new_tokens={max_new_tokens} "
                            f"pass the model's {positions} positions (model.sequence_length); shorten the prompt, "
                            f"lower max_new_tokens or raise model.sequence_length (up to the checkpoint's positions)")
    # A stop the model cannot emit (a tokenizer's <|endoftext|> past its vocabulary) is none.
    stops = list(cfg.model.eos_token_ids) or [tokenizer.token_to_id(EOS)]
    if chat:
        stops += chat_stops(cfg, tokenizer, Path(cfg.checkpoint.load or cfg.model.hf_checkpoint))
    stops = sorted({t for t in stops if t is not None and 0 <= t < vocab})
    engine = inference_engine(cfg, hooks)
    runner = LayerMajor(engine)
    seed = sampling.pop("seed", 0)
    generator = torch.Generator(engine.device).manual_seed(seed)
    measured = Measured(engine)
    new = []
    for chunk in batches(encoded, batch_size):
        new += generate(runner, chunk, max_new_tokens, eos_id=stops, generator=generator,
                        **sampling)
    count = sum(len(n) for n in new)
    if chat:
        completions = [tokenizer.decode(n, skip_special_tokens=True) for n in new]
    else:
        completions = [p + tokenizer.decode(n, skip_special_tokens=False) for p, n in zip(prompts, new)]
    return {"completions": completions, "new_tokens": count, **measured.figures(count)}
