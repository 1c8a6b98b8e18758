"""The run's tokenizer: ``data.tokenizer`` (the shipped sample, a directory holding ``tokenizer.json``, or the
file), else the checkpoint's. Loaded by the ``tokenizers`` library; nothing reaches the network.

What it adds to a text is its own: the post-processor in its tokenizer.json (Llama 3's puts
``<|begin_of_text|>`` first; Qwen2's, SmolLM2's and GPT-J's add nothing), read once as :class:`Specials`
together with the token that ends a document (tokenizer_config.json's ``eos_token``), so that training data
and ``generate``'s prompts are encoded alike, as transformers' tokenizer encodes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ipuft.errors import DataError, first_line
from ipuft.io.files import read_bounded

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

SAMPLE_TOKENIZER = "sample"
EOS = "<|endoftext|>"  # GPT-J's end-of-text token


def tokenizer_path(spec: str) -> Path:
    """Where the tokenizer.json named by ``spec`` is: ``"sample"`` (shipped with ipuft), a directory
    holding it, or the file itself (which may not exist)."""
    if spec == SAMPLE_TOKENIZER:
        return Path(str(resources.files("ipuft.sample_data") / "tokenizer.json"))
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_source(cfg: DictConfig) -> tuple[str, str] | None:
    """The run's tokenizer: ``(spec, config key)`` of ``data.tokenizer``, else of ``model.hf_checkpoint``
    (its directory holds tokenizer.json); ``None`` when neither is set."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer, "data.tokenizer"
    if cfg.model.get("hf_checkpoint") is not None:
        return cfg.model.hf_checkpoint, "model.hf_checkpoint"
    if cfg.model.get("init_checkpoint") is not None:
        from ipuft.io.checkpoint import find_checkpoint

        return str(find_checkpoint(cfg.model.init_checkpoint)), "model.init_checkpoint"
    return None


TOKENIZER_LIMIT = 1 << 30  # bytes a checkpoint's tokenizer.json may take; real ones are a few MB


def tokenizer_from_bytes(data: bytes, path: Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from the bytes of ``path`` (a checkpoint's tokenizer.json, read and verified
    by the caller); one line naming ``path`` if they are not a tokenizer."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 (a bad encoding, or the Rust side's plain Exceptions)
        why = first_line(exc, type(exc).__name__)[:200]
        raise DataError(f"{path} is not a valid tokenizer.json ({why})") from None


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from ``"sample"`` (shipped with ipuft), a directory holding
    ``tokenizer.json``, or the file itself: a regular file of at most :data:`TOKENIZER_LIMIT` bytes
    (:func:`ipuft.io.files.read_bounded`). ``key`` names the config key in error messages."""
    from tokenizers import Tokenizer

    path = tokenizer_path(spec)
    if not path.exists() and not path.is_symlink():
        raise DataError(f"{key}: no tokenizer.json at {path}; give a directory holding tokenizer.json "
                        f"or the file itself")
    data = read_bounded(path, TOKENIZER_LIMIT, f"{key}: {path}", DataError, "; a tokenizer.json is a few MB")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 (the Rust side raises plain Exceptions)
        why = first_line(exc, type(exc).__name__)
        raise DataError(f"{key}: {path} is not a valid tokenizer.json ({why})") from None


@dataclass(frozen=True)
class Specials:
    """What the tokenizer adds around one text: ``prefix`` and ``suffix``, the ids its post-processor puts before
    and after the text's own (``encode(text)`` with special tokens is ``prefix + ids + suffix``), and ``eos``, the
    id that ends a document (None where the tokenizer names none)."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    eos: int | None = None

    def wrap(self, ids: list[int]) -> list[int]:
        """``ids`` as the tokenizer's post-processor gives them: between :attr:`prefix` and :attr:`suffix`."""
        return [*self.prefix, *ids, *self.suffix]


_PROBES = ("a", "0", " ", "x y")  # texts whose encoding has a token of their own, to tell prefix from suffix


def post_processor_ids(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``tokenizer``'s post-processor puts before and after one sequence's own, found by encoding a short
    text with special tokens: the tokens of no sequence (``sequence_ids`` None) before its first token and after
    its last."""
    for probe in _PROBES:
        encoding = tokenizer.encode(probe, add_special_tokens=True)
        own = [i for i, s in enumerate(encoding.sequence_ids) if s is not None]
        if own:
            return tuple(encoding.ids[:own[0]]), tuple(encoding.ids[own[-1] + 1:])
    return tuple(tokenizer.encode("", add_special_tokens=True).ids), ()


def token_name(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_config(cfg: DictConfig) -> dict | None:
    """The run's tokenizer_config.json (untrusted, checked as a JSON object), from the directory or checkpoint its
    tokenizer comes from (:func:`tokenizer_source`); None where there is none (a lone tokenizer.json, the sample)."""
    from ipuft.io.model_files import home_files

    source = tokenizer_source(cfg)
    if source is None or source[0] == SAMPLE_TOKENIZER or not Path(source[0]).is_dir():
        return None
    found = home_files(Path(source[0]), ("tokenizer_config.json",), f"{source[1]}: ")
    return json.loads(found["tokenizer_config.json"]) if found else None


def check_in_vocabulary(ids, vocab_size: int, what: str) -> None:
    """Each of ``ids`` (from a tokenizer: its specials, a prompt's encoding) is a token of the model's
    ``vocab_size``; else one line naming ``what`` gave it, the id and the vocabulary's size."""
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise DataError(f"{what}: token id {token_id} is outside the model's vocabulary (0 to {vocab_size - 1}: "
                            f"model.embedding.vocab_size={vocab_size}); the tokenizer is not the model's")


def specials(tokenizer: Tokenizer, cfg: DictConfig) -> Specials:
    """What ``tokenizer`` adds (its post-processor's ids) and the token that ends a document: tokenizer_config.json's
    ``eos_token`` where the tokenizer's directory has one, else the model's first ``model.eos_token_ids``, else
    <|endoftext|> where the vocabulary has it. Every id it names is checked against the model's vocabulary."""
    prefix, suffix = post_processor_ids(tokenizer)
    vocab = cfg.model.embedding.vocab_size
    source = tokenizer_source(cfg)
    where = source[1] if source is not None else "data.tokenizer"
    check_in_vocabulary(prefix + suffix, vocab, f"{where}: what its post-processor adds")
    settings = tokenizer_config(cfg) or {}
    name = token_name(settings.get("eos_token"))
    if name is not None:
        eos = tokenizer.token_to_id(name)
        if eos is None:
            raise DataError(f"{where}: tokenizer_config.json's eos_token {name[:40]!r} is not a token of its "
                            f"tokenizer.json")
        check_in_vocabulary([eos], vocab, f"{where}: tokenizer_config.json's eos_token {name[:40]!r}")
    elif len(cfg.model.eos_token_ids):
        eos = int(cfg.model.eos_token_ids[0])  # checked against the vocabulary with the config
    else:
        eos = tokenizer.token_to_id(EOS)
        if eos is not None and eos >= vocab:
            eos = None  # a guess that is no token of this model: none named
    return Specials(prefix, suffix, eos)
