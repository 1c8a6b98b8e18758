"""A tokenizer.json as a GGUF file's tokenizer (:mod:`ipuft.io.gguf_export`), in the two forms llama.cpp runs
for the families ipuft exports:

- byte-level BPE (GPT-2, Llama 3, Qwen2/3): ``tokenizer.ggml.model`` ``gpt2``, the tokens as the vocabulary
  spells them, the merges, and ``tokenizer.ggml.pre`` named by the pre-tokenizer's split: ``gpt-2`` (ByteLevel's
  own regex), ``llama-bpe`` (Llama 3's) or ``qwen2`` (Qwen2's);
- BPE with byte fallback (Llama 2, Mistral, Gemma: sentencepiece's pieces, ``▁`` for a space):
  ``tokenizer.ggml.model`` ``llama``, each token with a score (the merge that makes it: earlier merges score
  higher, as sentencepiece's do) and a type (``<0xNN>`` bytes, the unknown token, special tokens as control,
  added ones as user-defined), whether a space is prefixed, and the merges.

The vocabulary is padded to the embeddings' rows with ``[PADn]`` tokens of type unused, as llama.cpp's
converter pads it. The special tokens' ids, the chat template and the merges are read as llama.cpp's converter
reads them (``gguf.SpecialVocab``: tokenizer_config.json, then config.json); whether a bos or an eos is added is
what the tokenizer itself does to a text, as ipuft encodes one. Anything else (WordLevel, Unigram, WordPiece,
another split) is refused in one line: llama.cpp would tokenize it otherwise.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ipuft.errors import CheckpointError

# The pre-tokenizer splits llama.cpp names (llama-vocab.cpp), as tokenizer.json's Split spells them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
WRITTEN = "byte-level BPE (GPT-2, Llama 3, Qwen) and byte-fallback BPE (Llama 2, Mistral, Gemma)"
# gguf.TokenType's values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF writes it: ``model`` (``gpt2`` or ``llama``), ``pre`` (gpt2's split), one token,
    type and (llama's) score per embedding row, whether llama's prefixes a space, and the tokenizer.json."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    space_prefix: bool | None
    text: str


def _refused(why: str) -> CheckpointError:
    return CheckpointError(f"--gguf: {why}; a GGUF export writes {WRITTEN} tokenizers only")


def _flat(step: dict | None) -> list[dict]:
    """A pre-tokenizer or normalizer as the list of its steps (a Sequence's, or itself)."""
    if not step:
        return []
    inner = step.get("pretokenizers", step.get("normalizers"))
    return [s for part in inner for s in _flat(part)] if step.get("type") == "Sequence" else [step]


def _byte_level_pre(steps: list[dict]) -> str:
    """``tokenizer.ggml.pre`` of a byte-level tokenizer's pre-tokenizer steps."""
    byte_level = next(s for s in steps if s.get("type") == "ByteLevel")
    splits = [s for s in steps if s.get("type") == "Split"]
    others = sorted({str(s.get("type")) for s in steps if s.get("type") not in ("Split", "ByteLevel")})
    if byte_level.get("add_prefix_space"):
        raise _refused("the tokenizer's ByteLevel pre-tokenizer adds a prefix space, which llama.cpp's does not")
    if not splits and not others and byte_level.get("use_regex", True):
        return "gpt-2"
    if len(splits) == 1 and not others and not byte_level.get("use_regex", True):
        split = splits[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex in SPLITS and split.get("behavior") == "Isolated" and not split.get("invert"):
            return SPLITS[regex]
    shown = others or [f"Split {str((s.get('pattern') or {}).get('Regex'))[:40]!r}" for s in splits]
    raise _refused(f"the tokenizer's pre-tokenizer ({', '.join(shown) or 'ByteLevel without its regex'}) is none "
                   f"that llama.cpp names (gpt-2, llama-bpe, qwen2)")


def _space_prefix(data: dict) -> bool:
    """Whether a byte-fallback tokenizer puts ``▁`` before a text (Llama 2's Metaspace or Prepend), or not
    (Gemma's)."""
    if any(s.get("type") == "Prepend" and s.get("prepend") == "▁" for s in _flat(data.get("normalizer"))):
        return True
    return any(s.get("type") == "Metaspace" and (s.get("prepend_scheme", "always") != "never"
                                                 if "prepend_scheme" in s else s.get("add_prefix_space", True))
               for s in _flat(data.get("pre_tokenizer")))


def _scores(merges: list) -> dict[str, float]:
    """Each token a merge makes, scored as sentencepiece scores its pieces: the earliest merge highest."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(merges):
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores.setdefault("".join(pair), -float(rank))
    return scores


def read_vocab(text: str, rows: int) -> Vocab:
    """tokenizer.json (``text``) as a GGUF tokenizer of ``rows`` tokens (the embeddings'); one
    :class:`CheckpointError` line for one that GGUF cannot carry as llama.cpp would run it."""
    try:
        data = json.loads(text)
        model = data["model"]
        vocab = dict(model["vocab"])
        added = {int(a["id"]): a for a in data.get("added_tokens") or []}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"--gguf: tokenizer.json is not a tokenizer ({type(exc).__name__}: {exc})"[:300]) \
            from None
    kind = model.get("type")
    steps = _flat(data.get("pre_tokenizer"))
    byte_level = any(s.get("type") == "ByteLevel" for s in steps)
    if kind != "BPE":
        raise _refused(f"the tokenizer is {str(kind)[:40]} (tokenizer.json's model.type)")
    if byte_level == bool(model.get("byte_fallback")):
        raise _refused("the tokenizer is a BPE with " + ("both a ByteLevel pre-tokenizer and byte fallback"
                                                        if byte_level else "neither byte fallback nor ByteLevel"))
    by_id = {int(i): t for t, i in vocab.items()} | {i: a["content"] for i, a in added.items()}
    if max(by_id, default=-1) >= rows:
        raise CheckpointError(f"--gguf: the tokenizer has token id {max(by_id)}, the embeddings only {rows} rows")
    unk = model.get("unk_token")
    tokens, types = [], []
    for i in range(rows):
        token = by_id.get(i)
        if token is None:
            token, kind_ = f"[PAD{i}]", UNUSED
        elif not byte_level and token == unk:
            kind_ = UNKNOWN
        elif i in added:
            kind_ = CONTROL if added[i].get("special") else USER_DEFINED
        elif not byte_level and _BYTE_TOKEN.fullmatch(token):
            kind_ = BYTE
        else:
            kind_ = NORMAL
        tokens.append(token)
        types.append(kind_)
    if byte_level:
        return Vocab("gpt2", _byte_level_pre(steps), tokens, types, None, None, text)
    scored = _scores(list(model.get("merges") or []))
    scores = [scored.get(t, 0.0) if k == NORMAL else 0.0 for t, k in zip(tokens, types)]
    return Vocab("llama", None, tokens, types, scores, _space_prefix(data), text)


def _added(text: str, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether the tokenizer puts ``bos`` before a text and ``eos`` after it, as ipuft's data encodes it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(text)
    bare = tokenizer.encode("a b", add_special_tokens=False).ids
    full = tokenizer.encode("a b", add_special_tokens=True).ids
    return (bos is not None and full[:1] == [bos] and bare[:1] != [bos],
            eos is not None and full[-1:] == [eos] and bare[-1:] != [eos])


def add_tokenizer(writer, vocab: Vocab, directory: Path) -> None:
    """Add ``vocab`` to GGUF ``writer``, with the special tokens, merges and chat template of Hugging Face
    directory ``directory`` (its tokenizer_config.json, chat_template.jinja and config.json)."""
    import gguf

    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.space_prefix is not None:
        writer.add_add_space_prefix(vocab.space_prefix)
    log = logging.getLogger("gguf.vocab")
    level = log.level
    log.setLevel(logging.ERROR)  # its notes on what a config lacks are for llama.cpp's converter's console
    try:
        special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(vocab.tokens))
        if vocab.model == "gpt2" and not special.merges:
            raise _refused("the byte-level tokenizer has no merges")
        ids = special.special_token_ids
        special.add_special_token.update(zip(("bos", "eos"), _added(vocab.text, ids.get("bos"), ids.get("eos"))))
        special.add_to_gguf(writer, quiet=True)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"--gguf: the tokenizer's files cannot be read as llama.cpp reads them ({exc})"[:300]) \
            from None
    finally:
        log.setLevel(level)
