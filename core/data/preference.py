"""Preference data (``data.format=preference``): rows of a prompt and a chosen and a rejected completion, in TRL's
column names, each pair served as two rows of one micro-batch.

A row of the file is one of (the same forms TRL's DPOTrainer takes):

- text: ``{"prompt": str, "chosen": str, "rejected": str}``. ``prompt + completion`` is encoded as the instruction
  format encodes a prompt and its target (each apart, so the completion starts at an exact token; the whole as
  the tokenizer's post-processor wraps one text: Llama 3's bos first), and the completion ends with the
  tokenizer's eos, as TRL ends it;
- conversational: ``prompt`` a list of ``{role, content}`` messages, ``chosen`` and ``rejected`` lists of the
  messages that answer it (usually one assistant turn); or, TRL's implicit prompt, ``chosen`` and ``rejected``
  whole conversations whose common first messages are the prompt (UltraFeedback's binarized rows, whose text
  ``prompt`` is then not used). The prompt is rendered by the chat template with the
  generation prompt; a completion is what rendering the whole conversation adds after it (ended as the template
  ends a turn), encoded as a rendered chat is, with nothing added;
- pre-tokenized: ``{"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}``, lists of ids taken as they
  are (nothing added).

Each pair becomes two examples, prompt + chosen and prompt + rejected, the prompt out of the loss; examples are
one to a row (``sequence_length + 1`` tokens, padded), and rows ``2i`` and ``2i + 1`` of a micro-batch are one
pair's (:class:`~ipuft.data.batch.Batch`). Batch sizes count rows: pair ``k`` of the stream is rows ``2k`` and
``2k + 1``, and a sampler over pairs (:class:`~ipuft.data.sampler.Sampler`) orders them. A pair too long for the
row is truncated (the prompt's last ``data.max_prompt_tokens`` kept where that is set, the completion's end cut),
dropped or refused by ``data.truncation`` (null: truncate); a prompt that leaves no room for a completion token,
an empty completion, chosen identical to rejected, a missing field or an id outside the vocabulary is one line
naming the row and the field. Nothing is cached (``data.cache``): preference files are small.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ipuft.components import IGNORE_INDEX
from ipuft.config.schema import Truncation
from ipuft.data.batch import Batch
from ipuft.data.builder import PAD_ID
from ipuft.data.chat import chat_template_of
from ipuft.data.files import read_rows, resolve_data_path
from ipuft.data.sampler import Sampler
from ipuft.errors import DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
IDS = tuple(f"{f}_input_ids" for f in FIELDS)


class PreferenceDataset:
    """Pairs of tokenized examples (``tokens`` flat int32, each example's ``offsets`` and prompt length), served
    as :class:`~ipuft.data.batch.Batch` objects of whole pairs."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, prompts: torch.Tensor, sequence_length: int,
                 shuffle: bool = True, seed: int = 0, name: str = "dataset", table: torch.Tensor | None = None):
        """Example ``e`` is ``tokens[offsets[e]:offsets[e + 1]]``, its first ``prompts[e]`` tokens the prompt;
        examples ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected. ``table``: the pairs this dataset
        serves, in order (a split); all by default."""
        self.tokens, self.offsets, self.prompts = tokens, offsets, prompts
        self.sequence_length, self.name, self.width = sequence_length, name, sequence_length + 1
        self.table = table
        self.pairs = len(table) if table is not None else (len(offsets) - 1) // 2
        if self.pairs == 0:
            raise DataError(f"{name}: the dataset is empty (no pair)")
        self.sampler = Sampler(self.pairs, shuffle, seed)
        self.reference: torch.Tensor | None = None  # each row's reference log-prob (ipuft.run.reference)
        self.held_out: PreferenceDataset | None = None

    def __len__(self) -> int:
        """Rows: two a pair."""
        return 2 * self.pairs

    @classmethod
    def from_config(cls, cfg: DictConfig, tokenizer: Tokenizer | None, path: str | None = None,
                    shuffle: bool | None = None, split: str | None = None) -> PreferenceDataset:
        data = cfg.data
        path = data.path if path is None else path
        resolved = resolve_data_path(path, split or data.split, data.subset)
        name = str(resolved)
        pairs = _Pairs(cfg, tokenizer, name)
        for number, row in read_rows(resolved, name):
            pairs.add(number, row)
        pairs.report()
        tokens = torch.tensor(pairs.tokens, dtype=torch.int32)
        offsets = torch.tensor(pairs.offsets, dtype=torch.long)
        prompts = torch.tensor(pairs.prompts, dtype=torch.long)
        return cls(tokens, offsets, prompts, cfg.model.sequence_length, data.shuffle if shuffle is None else shuffle,
                   data.seed, name)

    def split(self, fraction: float, seed: int) -> PreferenceDataset:
        """This dataset without a ``fraction`` of its pairs, drawn by ``seed``; those pairs, in order and
        unshuffled, are ``held_out`` of the result (``data.validation_fraction``)."""
        held = max(1, round(self.pairs * fraction))
        if held >= self.pairs:
            raise DataError(f"data.validation_fraction: holding out {held} of {self.name}'s {self.pairs} pairs leaves "
                            f"nothing to train on; lower it or add rows")
        order = torch.randperm(self.pairs, generator=torch.Generator().manual_seed(seed + 7919))
        args = (self.tokens, self.offsets, self.prompts, self.sequence_length)
        train = PreferenceDataset(*args, self.sampler.shuffle, self.sampler.seed, self.name, order[held:].sort().values)
        train.held_out = PreferenceDataset(*args, False, 0, f"{self.name} (validation split)",
                                           order[:held].sort().values)
        return train

    def fingerprint(self) -> str:
        """A SHA-256 of the pairs this dataset serves (their tokens and prompt lengths, in order): a changed dataset
        has another."""
        h = hashlib.sha256(f"ipuft-preference {self.pairs} {self.width}".encode())
        for k in range(self.pairs):
            ids, prompt = self._pair(k)
            for example, length in zip(ids, prompt, strict=True):
                h.update(example.numpy().tobytes())
                h.update(int(length).to_bytes(8, "little"))
        return h.hexdigest()

    def _pair(self, k: int) -> tuple[list[torch.Tensor], list[int]]:
        pair = int(self.table[k]) if self.table is not None else k
        ids = [self.tokens[self.offsets[e]:self.offsets[e + 1]] for e in (2 * pair, 2 * pair + 1)]
        return ids, [int(self.prompts[2 * pair]), int(self.prompts[2 * pair + 1])]

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``index`` (pair ``index // 2``'s chosen or rejected) as ``(input_ids, labels)`` of ``sequence_length``
        each: the labels the next tokens of the completion, ``IGNORE_INDEX`` on the prompt and the padding."""
        ids, prompts = self._pair(index // 2)
        example, prompt = ids[index % 2].long(), prompts[index % 2]
        padded = torch.full((self.width,), PAD_ID, dtype=torch.long)
        padded[:len(example)] = example
        labels = padded[1:].clone()
        trained = torch.zeros(self.sequence_length, dtype=torch.bool)
        trained[prompt - 1:len(example) - 1] = True  # label t is token t + 1: the completion's tokens
        labels[~trained] = IGNORE_INDEX
        return padded[:-1], labels

    def _batch(self, rows: torch.Tensor) -> Batch:
        """The rows ``rows[M, R]`` as a batch of ``M`` micro-batches, each row's reference log-prob with it."""
        got = [self.row(int(r)) for r in rows.reshape(-1)]
        shape = (*rows.shape, self.sequence_length)
        reference = torch.zeros(rows.shape) if self.reference is None else self.reference[rows]
        return Batch(torch.stack([g[0] for g in got]).reshape(shape), torch.stack([g[1] for g in got]).reshape(shape),
                     None, reference.float())

    def batch_at(self, start: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
                 replicas: int = 1) -> Batch:
        """Rank ``rank``'s share of the ``global_batch_size`` rows from row ``start`` of the stream (pair
        ``start // 2`` on): micro-batches of ``micro_batch_size`` rows, whole pairs, rank ``r`` of ``replicas``
        taking micro-batches ``r, r + replicas, ...``."""
        pairs = self.sampler.indices(start // 2, global_batch_size // 2)
        rows = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)
        self.sampler.samples_seen = max(self.sampler.samples_seen, (start + global_batch_size) // 2)
        return self._batch(rows.reshape(-1, micro_batch_size)[rank::replicas])

    def batch(self, step: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
              replicas: int = 1) -> Batch:
        """Global batch ``step``: its rows ``[step × GBS, (step + 1) × GBS)`` of the stream (see :meth:`batch_at`)."""
        return self.batch_at(step * global_batch_size, global_batch_size, micro_batch_size, rank, replicas)

    def eval_batches(self, micro_batch_size: int, replica: int = 0, replicas: int = 1) -> Iterator[Batch]:
        """Every row once, in order (row ``k`` the ``k``-th), unshuffled, as batches of one micro-batch of
        ``micro_batch_size`` rows (the last may be smaller; whole pairs each); with ``replicas``, only every
        ``replicas``-th micro-batch, from the ``replica``-th on."""
        for start in range(replica * micro_batch_size, len(self), micro_batch_size * replicas):
            yield self._batch(torch.arange(start, min(start + micro_batch_size, len(self)))[None])

    def state_dict(self) -> dict[str, int]:
        """The data position, in pairs (:meth:`Sampler.state_dict`)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


class _Pairs:
    """Reads rows into pairs of examples, checking each as it comes (see the module docstring)."""

    def __init__(self, cfg: DictConfig, tokenizer: Tokenizer | None, name: str) -> None:
        from ipuft.data.tokenizer import specials

        self.cfg, self.tokenizer, self.name = cfg, tokenizer, name
        self.width, self.vocab = cfg.model.sequence_length + 1, cfg.model.embedding.vocab_size
        self.truncation = Truncation(cfg.data.truncation) if cfg.data.truncation is not None else Truncation.truncate
        self.max_prompt = cfg.data.max_prompt_tokens
        self.added = specials(tokenizer, cfg) if tokenizer is not None else None
        self._chat = None
        self.tokens: list[int] = []
        self.offsets, self.prompts = [0], []
        self.seen = self.dropped = self.truncated = 0

    def chat(self):
        if self._chat is None:
            self._chat = chat_template_of(self.cfg)
        return self._chat

    def add(self, number: int, row: dict[str, Any]) -> None:
        where = f"{self.name} row {number}"
        self.seen += 1
        if all(f in row for f in IDS):
            prompt, chosen, rejected = (_ids(row[f], f"{where}: {f}") for f in IDS)
        elif isinstance(row.get("chosen"), list) and isinstance(row.get("rejected"), list) \
                and not isinstance(row.get("prompt"), list):
            prompt, chosen, rejected = self._conversation(*_implicit_prompt(row, where), where)
        elif all(f in row for f in FIELDS):
            prompt, chosen, rejected = self._encoded(row, where)
        else:
            present = ", ".join(str(k)[:40] for k in row) or "(no fields)"
            missing = [f for f in FIELDS if f not in row] if any(f in row for f in FIELDS) else \
                [f for f in IDS if f not in row] if any(f in row for f in IDS) else list(FIELDS)
            raise DataError(f"{where}: field {missing[0]!r} is missing (data.format=preference takes prompt, chosen "
                            f"and rejected, or their *_input_ids); the row has: {present}")
        names = IDS if "prompt_input_ids" in row else FIELDS
        if not prompt:
            raise DataError(f"{where}: {names[0]} is empty; a completion is predicted from at least one token")
        for ids, field in ((chosen, names[1]), (rejected, names[2])):
            if not ids:
                raise DataError(f"{where}: {field} is an empty completion")
        if chosen == rejected:
            raise DataError(f"{where}: {names[1]} and {names[2]} are the same tokens; a pair prefers one of two")
        for ids, field in ((prompt, names[0]), (chosen, names[1]), (rejected, names[2])):
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise DataError(f"{where}: {field}: token id {bad[0]} is outside the model's vocabulary "
                                f"(model.embedding.vocab_size = {self.vocab})")
        fitted = self._fitted(prompt, [chosen, rejected], where, names[0])
        if fitted is None:
            self.dropped += 1
            return
        prompt, completions = fitted
        for completion in completions:
            self.tokens.extend(prompt + completion)
            self.offsets.append(len(self.tokens))
            self.prompts.append(len(prompt))

    def _fitted(self, prompt: list[int], completions: list[list[int]], where: str, field: str):
        """The pair fitted to the row by ``data.truncation`` (None: dropped)."""
        if self.truncation is Truncation.truncate and self.max_prompt is not None:
            prompt = prompt[-self.max_prompt:]
        longest = len(prompt) + max(len(c) for c in completions)
        if longest <= self.width:
            return prompt, completions
        if self.truncation is Truncation.drop:
            return None
        if len(prompt) >= self.width:
            raise DataError(f"{where}: {field} has {len(prompt)} tokens, leaving no room for a completion in "
                            f"model.sequence_length + 1 = {self.width}; raise model.sequence_length, set "
                            f"data.max_prompt_tokens, or data.truncation=drop")
        if self.truncation is Truncation.error:
            raise DataError(f"{where}: the pair has {longest} tokens, longer than model.sequence_length + 1 = "
                            f"{self.width}; set data.truncation=truncate or drop")
        self.truncated += 1
        return prompt, [c[:self.width - len(prompt)] for c in completions]

    def _encoded(self, row: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
        if self.tokenizer is None:
            raise DataError(f"{where}: text rows need a tokenizer; set data.tokenizer=DIR or model.hf_checkpoint=DIR "
                            f"(or give prompt_input_ids, chosen_input_ids and rejected_input_ids)")
        values = [row[f] for f in FIELDS]
        if all(isinstance(v, str) for v in values):
            return self._text(*values, where)
        if all(isinstance(v, list) for v in values):
            return self._conversation(*values, where)
        kinds = ", ".join(f"{f} {type(v).__name__}" for f, v in zip(FIELDS, values, strict=True))
        raise DataError(f"{where}: prompt, chosen and rejected must all be text or all message lists; got {kinds}")

    def _text(self, prompt: str, chosen: str, rejected: str, where: str):
        eos = self.added.eos
        if eos is None:
            raise DataError("data.format=preference: the tokenizer names no end-of-sequence token to end each text "
                            "completion (no tokenizer_config.json eos_token, no model.eos_token_ids)")
        p, c, r = (e.ids for e in self.tokenizer.encode_batch([prompt, chosen, rejected], add_special_tokens=False))
        for ids, field in ((c, "chosen"), (r, "rejected")):
            if not ids:
                raise DataError(f"{where}: {field} is an empty completion")
        # The whole as the post-processor wraps one text; the completion ends with eos, as TRL ends it.
        start, suffix = list(self.added.prefix) + p, list(self.added.suffix)
        return start, c + suffix + ([eos] if (c + suffix)[-1:] != [eos] else []), \
            r + suffix + ([eos] if (r + suffix)[-1:] != [eos] else [])

    def _conversation(self, prompt: list, chosen: list, rejected: list, where: str):
        from ipuft.data.chat import check_messages

        template = self.chat()
        messages = check_messages(prompt, where, "prompt")
        head = template.render(messages, True, where)[0]
        out = [self.tokenizer.encode(head, add_special_tokens=False).ids]
        for answer, field in ((chosen, "chosen"), (rejected, "rejected")):
            whole = template.render(messages + check_messages(answer, where, field), False, where)[0]
            if not whole.startswith(head) or len(whole) == len(head):
                raise DataError(f"{where}: the chat template ({template.source}) renders prompt + {field} not as the "
                                f"prompt with the generation prompt followed by the {field} turn")
            out.append(self.tokenizer.encode(whole[len(head):], add_special_tokens=False).ids)
        return out[0], out[1], out[2]

    def report(self) -> None:
        for count, what in ((self.dropped, "longer than model.sequence_length + 1 and were left out "
                                           "(data.truncation=drop)"),
                            (self.truncated, "longer than model.sequence_length + 1 and their completions were cut "
                                             "to fit (data.truncation=truncate)")):
            if count:
                sys.stderr.write(f"ipuft: note: {self.name}: {count} of {self.seen} pairs are {what}\n")


def _implicit_prompt(row: dict[str, Any], where: str) -> tuple[list, list, list]:
    """TRL's implicit prompt: conversations ``chosen`` and ``rejected`` that begin with the same messages (the
    prompt, as in UltraFeedback's binarized rows, whose ``prompt`` is then its text alone) as ``(prompt, chosen,
    rejected)`` message lists, the prompt their longest common start."""
    chosen, rejected = row["chosen"], row["rejected"]
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(f"{where}: chosen and rejected are conversations that share no first message, and the row has "
                        f"no prompt message list; give prompt as a list of messages, or start both with the prompt")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DataError(f"{where} must be a list of integer token ids")
    return value
