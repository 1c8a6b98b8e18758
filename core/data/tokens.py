"""Tokenized datasets: rows read from a local file, tokenized, and served in batches as :class:`SampleData`
serves its own.

The pipeline is :func:`~ipuft.data.files.read_rows` (a file → numbered dicts) → :class:`TokenDataset` (dicts →
token ids, by ``data.format``, then packed into fixed chunks or kept one example per row) → ``batch(step, ...)``.
Tokenization happens once, up front; the dataset keeps one flat int32 tensor of token ids plus offsets,
never padded copies, and builds each padded row when a batch asks for it.

Which rows make global batch ``step`` depends only on the step and the sampler's seed (see
:class:`Sampler`), so a resumed run that keeps ``training.global_batch_size`` gets the same data by
calling ``batch(step, ...)`` for the steps it has left. Nothing here touches the network.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from ipuft.components import IGNORE_INDEX
from ipuft.config.schema import DataFormat
from ipuft.data.batch import Batch
from ipuft.data.cache import TokenCache
from ipuft.data.files import read_rows, resolve_data_path
from ipuft.data.synthetic import SampleData
from ipuft.data.templates import Template, resolve_template
from ipuft.data.tokenizer import Specials, load_tokenizer, specials, tokenizer_source
from ipuft.errors import DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

# Padding of unpacked rows: the id never reaches the loss (its labels are IGNORE_INDEX), and 0 is a valid
# id for every vocabulary, so no tokenizer needs a pad token.
PAD_ID = 0
# Rows are tokenized this many at a time: encode_batch parallelises within a chunk, and the chunk bounds
# the Python strings held at once.
ENCODE_CHUNK = 1024


# -- Sampling ------------------------------------------------------------------------------------------


class Sampler:
    """The order in which rows are served: epochs concatenated into one endless stream of row indices.

    Sample ``k`` of the stream is row ``order(k // size)[k % size]``, where an epoch's order is a
    permutation drawn from ``seed + epoch`` when shuffling, and file order otherwise. Nothing else is
    needed to find any sample, so the position of a run is just the number of samples it has consumed.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.samples_seen = 0
        # A global batch touches at most two epochs; a few cached permutations make consecutive steps cheap.
        self._order = lru_cache(maxsize=4)(self._epoch_order)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Row indices of samples ``start, ..., start + count - 1`` of the stream."""
        parts, k, end = [], start, start + count
        while k < end:
            epoch, offset = divmod(k, self.size)
            take = min(self.size - offset, end - k)
            parts.append(self._order(epoch)[offset:offset + take])
            k += take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def state_dict(self) -> dict[str, int]:
        """The sampler's position: ``{"seed", "shuffle", "rows", "samples_seen"}``."""
        return {"seed": self.seed, "shuffle": int(self.shuffle), "rows": self.size,
                "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`; the dataset must have the same number of rows."""
        if int(state["rows"]) != self.size:
            raise DataError(f"data: the saved data position is for a dataset of {state['rows']} rows; "
                            f"this one has {self.size}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.samples_seen = int(state["samples_seen"])
        self._order.cache_clear()


# -- The dataset ---------------------------------------------------------------------------------------


class TokenDataset:
    """Tokenized rows of ``sequence_length + 1`` tokens, served as :class:`~ipuft.data.batch.Batch` objects.

    Packed, row ``i`` is chunk ``i`` of the concatenated examples and every token is in the loss.
    Unpacked, row ``i`` is example ``i``, padded with :data:`PAD_ID`; labels are ``IGNORE_INDEX`` where
    the next token is padding or, for a template with a target, part of the prompt.
    """

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor | None, target_starts: torch.Tensor | None,
                 sequence_length: int, shuffle: bool = True, seed: int = 0, name: str = "dataset",
                 table: torch.Tensor | None = None) -> None:
        """``tokens``: flat int32 ids. Packed: ``offsets is None`` and ``tokens`` holds whole chunks of
        ``sequence_length + 1``. Unpacked: example ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` and its
        loss starts at token ``target_starts[i]`` (0: every token). ``table``: the rows of those that this
        dataset serves, in order (a split); all of them by default."""
        self.tokens, self.offsets, self.target_starts = tokens, offsets, target_starts
        self.sequence_length, self.name = sequence_length, name
        self.width = sequence_length + 1
        self.packed = offsets is None
        self.table = table
        rows = len(table) if table is not None else len(tokens) // self.width if self.packed else len(offsets) - 1
        if rows == 0:
            raise DataError(f"{name}: the dataset is empty")
        self.sampler = Sampler(rows, shuffle, seed)
        self.held_out: TokenDataset | None = None  # the validation rows split off by split()

    def split(self, fraction: float, seed: int) -> TokenDataset:
        """This dataset without a ``fraction`` of its rows, drawn by ``seed``; those rows, in order and
        unshuffled, become ``held_out`` of the result (``data.validation_fraction``)."""
        count = len(self)
        held = max(1, round(count * fraction))
        if held >= count:
            raise DataError(f"data.validation_fraction: holding out {held} of {self.name}'s {count} rows leaves "
                            f"nothing to train on; lower it or add rows")
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + 7919))
        validation, training = order[:held].sort().values, order[held:].sort().values
        args = (self.tokens, self.offsets, self.target_starts, self.sequence_length)
        train = TokenDataset(*args, self.sampler.shuffle, self.sampler.seed, self.name, training)
        train.held_out = TokenDataset(*args, False, 0, f"{self.name} (validation split)", validation)
        return train

    @classmethod
    def from_config(cls, cfg: DictConfig, tokenizer: Tokenizer | None, path: str | None = None,
                    shuffle: bool | None = None) -> TokenDataset:
        """Read, tokenize and check ``data.path`` (or ``path``) as ``cfg.data`` says (format, template,
        packing; ``shuffle`` overrides ``data.shuffle``)."""
        data = cfg.data
        fmt = DataFormat(data.format)
        path = data.path if path is None else path
        name = str(path)
        if fmt is not DataFormat.tokens and tokenizer is None:
            raise DataError(f"data.tokenizer: format {fmt.value!r} needs a tokenizer; set data.tokenizer=DIR "
                            f"or model.hf_checkpoint=DIR")
        resolved = resolve_data_path(path)
        added = specials(tokenizer, cfg) if tokenizer is not None else Specials()
        ends = data.packing and data.add_eos and fmt is not DataFormat.tokens  # packed examples end with eos
        if ends and added.eos is None:
            raise DataError("data.add_eos: the tokenizer names no end-of-sequence token (no tokenizer_config.json "
                            "eos_token, no model.eos_token_ids, no <|endoftext|> in its vocabulary); set "
                            "data.add_eos=false, or give data.tokenizer a directory with tokenizer_config.json")
        eos = added.eos if ends else None
        cache = TokenCache.for_config(cfg, resolved, tokenizer, (added.prefix, added.suffix, eos)) \
            if data.cache else None
        shuffle = data.shuffle if shuffle is None else shuffle
        if cache is not None and (hit := cache.load(name, cfg.model.embedding.vocab_size)) is not None:
            tokens, offsets, target_starts = hit
            return cls(tokens, offsets, target_starts, cfg.model.sequence_length, shuffle, data.seed, name)
        builder = _Builder(name, cfg.model.sequence_length, cfg.model.embedding.vocab_size, data.packing)
        rows = read_rows(resolved, name)
        if fmt is DataFormat.tokens:
            for number, row in rows:
                builder.add(number, _token_ids(row, number, name), 0)
        elif fmt is DataFormat.text:
            _encode(builder, tokenizer, ((n, _text(row, data.text_field, f"{name} row {n}"), None)
                                         for n, row in rows), added, eos)
        else:
            template = resolve_template(data.template)
            _encode(builder, tokenizer, ((n, *_rendered(template, row, f"{name} row {n}")) for n, row in rows),
                    added, eos)
        dataset = builder.build(shuffle=shuffle, seed=data.seed)
        if cache is not None:
            cache.store(dataset)
        return dataset

    def __len__(self) -> int:
        """The number of rows: examples (unpacked) or chunks (packed)."""
        return self.sampler.size

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``index`` as ``(input_ids, labels)``, int64 tensors of ``sequence_length`` each."""
        if self.table is not None:
            index = int(self.table[index])
        if self.packed:
            chunk = self.tokens[index * self.width:(index + 1) * self.width].long()
            return chunk[:-1], chunk[1:]
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        length = end - start
        padded = torch.full((self.width,), PAD_ID, dtype=torch.long)
        padded[:length] = self.tokens[start:end]
        labels = padded[1:].clone()
        # The label at position t is token t + 1: keep it only where that token is real and in the target.
        position = torch.arange(1, self.width)
        labels[(position >= length) | (position < int(self.target_starts[index]))] = IGNORE_INDEX
        return padded[:-1], labels

    def _rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.row(int(i)) for i in indices.reshape(-1)]
        shape = (*indices.shape, self.sequence_length)
        return (torch.stack([p[0] for p in pairs]).reshape(shape),
                torch.stack([p[1] for p in pairs]).reshape(shape))

    def batch_at(self, start: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
                 replicas: int = 1) -> Batch:
        """Data-parallel ``rank``'s share of the ``global_batch_size`` samples from stream position ``start``.

        The samples are cut into micro-batches of consecutive samples; rank ``r`` of ``replicas`` takes
        micro-batches ``r, r + replicas, ...`` (as :meth:`SampleData.batch` does).
        """
        indices = self.sampler.indices(start, global_batch_size)
        micro = indices.reshape(-1, micro_batch_size)[rank::replicas]
        input_ids, labels = self._rows(micro)
        self.sampler.samples_seen = max(self.sampler.samples_seen, start + global_batch_size)
        return Batch(input_ids, labels)

    def batch(self, step: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
              replicas: int = 1) -> Batch:
        """Global batch ``step``: samples ``[step × GBS, (step + 1) × GBS)`` of the stream, as ``[GA, mbs, seq]``.

        The result depends only on ``step`` and the sampler's state (its seed), never on earlier calls;
        afterwards :meth:`state_dict` reports ``samples_seen = (step + 1) × GBS`` (or more).
        """
        return self.batch_at(step * global_batch_size, global_batch_size, micro_batch_size, rank, replicas)

    def eval_batches(self, micro_batch_size: int, replica: int = 0, replicas: int = 1) -> Iterator[Batch]:
        """Every row once, in order, unshuffled, as batches of one micro-batch (the last may be smaller);
        with ``replicas``, only every ``replicas``-th micro-batch, from the ``replica``-th on."""
        for start in range(replica * micro_batch_size, len(self), micro_batch_size * replicas):
            input_ids, labels = self._rows(torch.arange(start, min(start + micro_batch_size, len(self)))[None])
            yield Batch(input_ids, labels)

    def state_dict(self) -> dict[str, int]:
        """The data position, for checkpoints: see :meth:`Sampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the data position (seed and samples seen) from :meth:`state_dict`."""
        self.sampler.load_state_dict(state)


class _Builder:
    """Collects examples into one flat int32 buffer, checking each as it arrives."""

    def __init__(self, name: str, sequence_length: int, vocab_size: int, packing: bool) -> None:
        self.name, self.width, self.vocab_size, self.packing = name, sequence_length + 1, vocab_size, packing
        self.tokens = array("i")
        self.offsets = array("q", [0])
        self.target_starts = array("q")

    def add(self, number: int, ids: list[int], target_start: int) -> None:
        """Append example ``ids`` from row ``number``; its loss starts at token ``target_start``."""
        if not ids:
            return
        top, bottom = max(ids), min(ids)
        if top >= self.vocab_size or bottom < 0:
            bad = top if top >= self.vocab_size else bottom
            raise DataError(f"{self.name} row {number}: token id {bad} is outside the model's vocabulary "
                            f"(model.embedding.vocab_size = {self.vocab_size})")
        if not self.packing:
            if len(ids) > self.width:
                raise DataError(f"{self.name} row {number}: {len(ids)} tokens, longer than "
                                f"model.sequence_length + 1 = {self.width}; shorten it or set data.packing=true")
            if len(ids) < 2 or target_start >= len(ids):
                return  # no position has a label: the row would only dilute its micro-batch
        self.tokens.extend(ids)
        self.offsets.append(len(self.tokens))
        self.target_starts.append(target_start)

    def build(self, shuffle: bool, seed: int) -> TokenDataset:
        tokens = torch.frombuffer(self.tokens, dtype=torch.int32) if self.tokens else torch.empty(0, dtype=torch.int32)
        if self.packing:
            # The reference's group_texts: concatenate everything, drop the remainder that fills no chunk.
            tokens = tokens[:len(tokens) // self.width * self.width].clone()
            return TokenDataset(tokens, None, None, self.width - 1, shuffle, seed, self.name)
        return TokenDataset(tokens.clone(), torch.tensor(self.offsets, dtype=torch.long),
                            torch.tensor(self.target_starts, dtype=torch.long), self.width - 1, shuffle, seed,
                            self.name)


def _token_ids(row: dict[str, Any], number: int, name: str) -> list[int]:
    """The ``input_ids`` of a ``tokens`` row: a list of ints, or its text "[1, 2]" / "1 2" (csv, tsv, txt)."""
    where = f"{name} row {number}"
    ids = row.get("input_ids")
    if ids is None:
        present = ", ".join(row) or "(no fields)"
        raise DataError(f"{where}: field 'input_ids' is missing (data.format=tokens); the row has: {present}")
    if isinstance(ids, str):
        try:
            ids = json.loads(ids) if ids.lstrip().startswith("[") else [int(t) for t in ids.replace(",", " ").split()]
        except ValueError:
            raise DataError(f"{where}: input_ids {ids[:40]!r} is not a list of integers") from None
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DataError(f"{where}: input_ids must be a list of integers")
    return list(ids)


def _text(row: dict[str, Any], field: str, where: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        if value is None:
            present = ", ".join(k for k, v in row.items() if v is not None) or "(no fields)"
            raise DataError(f"{where}: field {field!r} (data.text_field) is missing; the row has: {present}")
        raise DataError(f"{where}: field {field!r} (data.text_field) is {type(value).__name__}, not text")
    return value


def _rendered(template: Template, row: dict[str, Any], where: str) -> tuple[str, str | None]:
    prompt, target = template.render(row, where)
    # Without a target the whole text is in the loss (target None); with one, only the target is.
    return prompt, target if template.target is not None else None


def _encode(builder: _Builder, tokenizer: Tokenizer, items: Iterator[tuple[int, str, str | None]],
            added: Specials, eos: int | None) -> None:
    """Tokenize ``(row_number, prompt, target)`` items in chunks and add them to ``builder``.

    Prompt and target are tokenized separately and concatenated, so the target starts at an exact token
    (a BPE merge across the boundary cannot blur it). Special tokens written in the text, such as
    ``<|endoftext|>``, become their single ids. The example is then wrapped as the tokenizer's post-processor
    wraps one text (``added``: Llama 3's bos before it), and ends with ``eos`` where given and it does not
    already end with it.
    """
    prefix = len(added.prefix)

    def flush(chunk: list[tuple[int, str, str | None]]) -> None:
        prompts = tokenizer.encode_batch([p for _, p, _ in chunk], add_special_tokens=False)
        with_target = [t for _, _, t in chunk if t is not None]
        targets = iter(tokenizer.encode_batch(with_target, add_special_tokens=False) if with_target else [])
        for (number, _, target), prompt in zip(chunk, prompts):
            ids = added.wrap(prompt.ids if target is None else prompt.ids + next(targets).ids)
            if eos is not None and ids[-1:] != [eos]:
                ids.append(eos)
            builder.add(number, ids, 0 if target is None else prefix + len(prompt.ids))

    chunk: list[tuple[int, str, str | None]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == ENCODE_CHUNK:
            flush(chunk)
            chunk = []
    if chunk:
        flush(chunk)


def validation_source(cfg: DictConfig, data: SampleData | TokenDataset | None = None) -> TokenDataset | None:
    """The validation rows: those of ``data.validation_path``, prepared as the training data is, in file
    order, or those ``data.validation_fraction`` held out of ``data`` (the training data); None if neither."""
    if cfg.data.validation_fraction:
        data = data if data is not None else data_source(cfg)
        return data.held_out
    if cfg.data.validation_path is None:
        return None
    source = tokenizer_source(cfg) if DataFormat(cfg.data.format) is not DataFormat.tokens else None
    return TokenDataset.from_config(cfg, None if source is None else load_tokenizer(*source),
                                    path=cfg.data.validation_path, shuffle=False)


def data_source(cfg: DictConfig) -> SampleData | TokenDataset:
    """The training data ``cfg`` asks for: the synthetic :class:`SampleData` when ``data.path`` is null,
    else a :class:`TokenDataset` tokenized by ``data.tokenizer`` (or ``model.hf_checkpoint``'s tokenizer)."""
    if cfg.data.path is None:
        return SampleData(cfg.model.embedding.vocab_size, cfg.model.sequence_length, cfg.data.seed)
    source = tokenizer_source(cfg) if DataFormat(cfg.data.format) is not DataFormat.tokens else None
    dataset = TokenDataset.from_config(cfg, None if source is None else load_tokenizer(*source))
    if cfg.data.validation_fraction:
        dataset = dataset.split(cfg.data.validation_fraction, cfg.data.seed)
    return dataset
