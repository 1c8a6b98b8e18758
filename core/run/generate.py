"""``ipuft generate``: continue prompts with a model from an ipuft checkpoint or a Hugging Face directory, in
one process, through an inference engine and the batched decoding of :mod:`ipuft.generate`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from ipuft.config import checkpoint_config, load_config
from ipuft.data.tokenizer import EOS, TOKENIZER_LIMIT, load_tokenizer, tokenizer_from_bytes
from ipuft.engine.inference import LayerMajor
from ipuft.errors import DataError
from ipuft.generate import generate
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


def generate_texts(cfg: DictConfig, hooks: PluginHooks, prompts: list[str], max_new_tokens: int,
                   batch_size: int = 8, **sampling) -> dict:
    """Continue each prompt, ``batch_size`` prompts decoded together; ``{"completions", "new_tokens",
    "tokens_per_s" (new tokens per second), "device_peak_bytes"}``. ``sampling``: temperature, top_k, top_p,
    seed (see :func:`ipuft.generate.generate`). Each prompt is encoded as the tokenizer encodes a text, with
    what its post-processor adds (Llama 3's <|begin_of_text|>; nothing for a tokenizer that adds nothing), as
    training data is; a row stops at any of ``model.eos_token_ids``, else at the tokenizer's <|endoftext|>."""
    tokenizer = tokenizer_for(cfg)
    encodings = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    for number, encoding in enumerate(encodings, start=1):
        if all(s is None for s in encoding.sequence_ids):  # nothing of the prompt's own, only added tokens
            raise DataError(f"prompt {number} is empty after tokenization")
    encoded = [encoding.ids for encoding in encodings]
    stops = [t for t in list(cfg.model.eos_token_ids) or [tokenizer.token_to_id(EOS)] if t is not None]
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
    return {"completions": [p + tokenizer.decode(n, skip_special_tokens=False) for p, n in zip(prompts, new)],
            "new_tokens": count, **measured.figures(count)}
