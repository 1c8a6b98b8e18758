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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ipuft.components import IGNORE_INDEX
from ipuft.config.schema import DataFormat, Truncation
from ipuft.data.batch import Batch
from ipuft.data.bounds import RenderBounds
from ipuft.data.builder import PAD_ID, Arrays, Builder, Layout
from ipuft.data.cache import TokenCache
from ipuft.data.files import read_rows, resolve_data_path
from ipuft.data.hf_datasets import DatasetSource
from ipuft.data.sampler import Sampler
from ipuft.data.synthetic import SampleData
from ipuft.data.templates import instruction_template, resolve_template
from ipuft.data.tokenizer import Specials, load_tokenizer, specials, tokenizer_source
from ipuft.errors import DataError

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

# Rows are tokenized this many at a time: encode_batch parallelises within a chunk, and the chunk bounds
# the Python strings held at once.
ENCODE_CHUNK = 1024


# -- Sampling ------------------------------------------------------------------------------------------


# -- The dataset ---------------------------------------------------------------------------------------


class TokenDataset:
    """Tokenized rows of ``sequence_length + 1`` tokens, served as :class:`~ipuft.data.batch.Batch` objects.

    The rows are laid out as :mod:`ipuft.data.builder` says: chunks of the concatenated examples, one example
    per row (padded with :data:`PAD_ID`), or examples packed whole (padded, with positions restarting at each
    example). Labels are ``IGNORE_INDEX`` where the next token is padding, belongs to another example, or is
    outside its example's loss mask (a prompt, a user turn).
    """

    def __init__(self, arrays: Arrays, sequence_length: int, shuffle: bool = True, seed: int = 0,
                 name: str = "dataset", table: torch.Tensor | None = None) -> None:
        """``arrays``: the tokens, their mask, the examples' offsets and rows (:class:`~ipuft.data.builder.Arrays`).
        ``table``: the rows of those that this dataset serves, in order (a split); all of them by default."""
        self.arrays = arrays
        self.tokens, self.mask, self.offsets, self.rows = arrays.tokens, arrays.mask, arrays.offsets, arrays.rows
        self.sequence_length, self.name = sequence_length, name
        self.width = sequence_length + 1
        self.packed = self.offsets is None  # chunks of the concatenated examples
        self.table = table
        count = len(self.tokens) // self.width if self.packed else \
            len(self.offsets) - 1 if self.rows is None else len(self.rows) - 1
        rows = len(table) if table is not None else count
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
        args = (self.arrays, self.sequence_length)
        train = TokenDataset(*args, self.sampler.shuffle, self.sampler.seed, self.name, training)
        train.held_out = TokenDataset(*args, False, 0, f"{self.name} (validation split)", validation)
        return train

    @classmethod
    def from_config(cls, cfg: DictConfig, tokenizer: Tokenizer | None, path: str | None = None,
                    shuffle: bool | None = None, split: str | None = None) -> TokenDataset:
        """Read, tokenize and check ``data.path`` (or ``path``) as ``cfg.data`` says (format, template,
        packing; ``shuffle`` overrides ``data.shuffle``)."""
        data = cfg.data
        fmt = DataFormat(data.format)
        path = data.path if path is None else path
        name = str(path)
        if fmt is not DataFormat.tokens and tokenizer is None:
            raise DataError(f"data.tokenizer: format {fmt.value!r} needs a tokenizer; set data.tokenizer=DIR "
                            f"or model.hf_checkpoint=DIR")
        resolved = resolve_data_path(path, split or data.split, data.subset)
        name = str(resolved) if isinstance(resolved, DatasetSource) else name
        added = specials(tokenizer, cfg) if tokenizer is not None else Specials()
        ends = data.add_eos and (fmt is DataFormat.instruction or (data.packing and fmt in TEXTS))
        if ends and added.eos is None:
            raise DataError("data.add_eos: the tokenizer names no end-of-sequence token (no tokenizer_config.json "
                            "eos_token, no model.eos_token_ids, no <|endoftext|> in its vocabulary); set "
                            "data.add_eos=false, or give data.tokenizer a directory with tokenizer_config.json")
        eos = added.eos if ends else None
        if fmt is DataFormat.chat:
            from ipuft.data.chat import chat_template_of
        chat = chat_template_of(cfg) if fmt is DataFormat.chat else None
        layout, masked, truncation = layout_of(cfg)
        shapes = (added.prefix, added.suffix, eos, chat.text if chat else None, layout.value, masked, truncation.value,
                  "tokens-tail-padded" if fmt is DataFormat.tokens else None)
        cache = TokenCache.for_config(cfg, resolved, tokenizer, shapes) if data.cache else None
        shuffle = data.shuffle if shuffle is None else shuffle
        if cache is not None and (hit := cache.load(name, cfg.model.embedding.vocab_size)) is not None:
            return cls(hit, cfg.model.sequence_length, shuffle, data.seed, name)
        hint = "; shorten it or set data.packing=true" if fmt in (DataFormat.tokens, *TEXTS) and not data.packing \
            else "; shorten it, or set data.truncation=truncate or drop"
        builder = Builder(name, cfg.model.sequence_length, cfg.model.embedding.vocab_size, layout, masked,
                          truncation, hint, pad_tail=fmt is DataFormat.tokens)
        rows = read_rows(resolved, name)
        if fmt is DataFormat.tokens:
            for number, row in rows:
                builder.add(number, _token_ids(row, number, name))
        elif fmt is DataFormat.text:
            _encode(builder, tokenizer, ((n, _text(row, data.text_field, f"{name} row {n}"), None)
                                         for n, row in rows), added, eos)
        elif fmt is DataFormat.chat:
            from ipuft.data.chat import check_messages

            def conversations():
                for n, row in rows:
                    where = f"{name} row {n}"
                    yield n, *chat.assistant_spans(check_messages(row.get(data.messages_field), where,
                                                                  data.messages_field), where)

            _encode_chat(builder, tokenizer, conversations())
        else:
            template = resolve_template(data.template) if fmt is DataFormat.template else \
                instruction_template(data.instruction_template, data.prompt_field, data.input_field,
                                     data.response_field)
            # Without a target the whole text is in the loss (target None); with one, only the target is.
            has_target = fmt is DataFormat.instruction or template.target is not None
            bounds = RenderBounds.of(data)
            _encode(builder, tokenizer, ((n, *_rendered(template, row, f"{name} row {n}", has_target, bounds))
                                         for n, row in rows), added, eos)
        builder.report()
        dataset = cls(builder.build(), cfg.model.sequence_length, shuffle, data.seed, name)
        if cache is not None:
            cache.store(dataset)
        return dataset

    def __len__(self) -> int:
        """The number of rows: examples (unpacked) or chunks (packed)."""
        return self.sampler.size

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``index`` as ``(input_ids, labels, positions)``, int64 tensors of ``sequence_length`` each;
        ``positions`` is None but for examples packed whole."""
        if self.table is not None:
            index = int(self.table[index])
        if self.packed:
            chunk = self.tokens[index * self.width:(index + 1) * self.width].long()
            labels = chunk[1:].clone()
            if self.mask is not None:
                labels[self.mask[index * self.width + 1:(index + 1) * self.width] == 0] = IGNORE_INDEX
            return chunk[:-1], labels, None
        first, last = (index, index + 1) if self.rows is None else (int(self.rows[index]), int(self.rows[index + 1]))
        padded = torch.full((self.width,), PAD_ID, dtype=torch.long)
        keep = torch.zeros(self.width, dtype=torch.bool)  # whether token t is a target of its example
        positions = torch.zeros(self.width, dtype=torch.long)
        at = 0
        for example in range(first, last):
            start, end = int(self.offsets[example]), int(self.offsets[example + 1])
            length = end - start
            padded[at:at + length] = self.tokens[start:end]
            # An example's first token is predicted from no token of its own: never a label.
            keep[at + 1:at + length] = True if self.mask is None else self.mask[start + 1:end].bool()
            positions[at:at + length] = torch.arange(length)
            at += length
        positions[at:] = torch.arange(self.width - at)  # the padding: an example of its own, out of the loss
        labels = padded[1:].clone()
        labels[~keep[1:]] = IGNORE_INDEX
        return padded[:-1], labels, positions[:-1] if self.rows is not None else None

    def _rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = [self.row(int(i)) for i in indices.reshape(-1)]
        shape = (*indices.shape, self.sequence_length)
        positions = None if self.rows is None else torch.stack([r[2] for r in rows]).reshape(shape)
        return (torch.stack([r[0] for r in rows]).reshape(shape), torch.stack([r[1] for r in rows]).reshape(shape),
                positions)

    def batch_at(self, start: int, global_batch_size: int, micro_batch_size: int, rank: int = 0,
                 replicas: int = 1) -> Batch:
        """Data-parallel ``rank``'s share of the ``global_batch_size`` samples from stream position ``start``.

        The samples are cut into micro-batches of consecutive samples; rank ``r`` of ``replicas`` takes
        micro-batches ``r, r + replicas, ...`` (as :meth:`SampleData.batch` does).
        """
        indices = self.sampler.indices(start, global_batch_size)
        micro = indices.reshape(-1, micro_batch_size)[rank::replicas]
        input_ids, labels, positions = self._rows(micro)
        self.sampler.samples_seen = max(self.sampler.samples_seen, start + global_batch_size)
        return Batch(input_ids, labels, positions)

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
            input_ids, labels, positions = self._rows(
                torch.arange(start, min(start + micro_batch_size, len(self)))[None])
            yield Batch(input_ids, labels, positions)

    def state_dict(self) -> dict[str, int]:
        """The data position, for checkpoints: see :meth:`Sampler.state_dict`."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the data position (seed and samples seen) from :meth:`state_dict`."""
        self.sampler.load_state_dict(state)


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


TEXTS = (DataFormat.text, DataFormat.template)  # the formats packed, by default, as the reference packed text
MASKED = (DataFormat.instruction, DataFormat.chat)  # the formats whose loss masks are always kept


def layout_of(cfg: DictConfig) -> tuple[Layout, bool, Truncation]:
    """How ``cfg.data`` lays the examples out, whether their loss masks are kept, and what an example too long
    for a row gets: see ``data.packing``, ``data.whole_examples`` and ``data.truncation`` (docs/data.md)."""
    data = cfg.data
    fmt = DataFormat(data.format)
    if fmt is DataFormat.preference:  # one example a row, never packed (ipuft.data.preference)
        return Layout.examples, True, Truncation(data.truncation or Truncation.truncate)
    whole = data.whole_examples if data.whole_examples is not None else fmt in MASKED
    layout = Layout.examples if not data.packing else Layout.whole if whole else Layout.chunks
    # Packed as chunks, a template's example trains on every token, as the reference's group_texts did.
    masked = fmt in MASKED or (fmt is DataFormat.template and layout is not Layout.chunks)
    truncation = Truncation(data.truncation) if data.truncation is not None else \
        Truncation.truncate if fmt in MASKED else Truncation.error
    return layout, masked, truncation


def _rendered(template, row: dict[str, Any], where: str, has_target: bool, bounds: RenderBounds
              ) -> tuple[str, str | None]:
    prompt, target = template.render(row, where, bounds)
    return prompt, target if has_target else None


def _chunks(items: Iterator, size: int = ENCODE_CHUNK) -> Iterator[list]:
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode(builder: Builder, tokenizer: Tokenizer, items: Iterator[tuple[int, str, str | None]],
            added: Specials, eos: int | None) -> None:
    """Tokenize ``(row_number, prompt, target)`` items in chunks and add them to ``builder``.

    Prompt and target are tokenized separately and concatenated, so the target starts at an exact token
    (a BPE merge across the boundary cannot blur it). Special tokens written in the text, such as
    ``<|endoftext|>``, become their single ids. The example is then wrapped as the tokenizer's post-processor
    wraps one text (``added``: Llama 3's bos before it), and ends with ``eos`` where given and it does not
    already end with it. Its mask: 0 up to the target's first token, 1 from it on (the eos included); none
    without a target.
    """
    prefix = len(added.prefix)
    for chunk in _chunks(items):
        prompts = tokenizer.encode_batch([p for _, p, _ in chunk], add_special_tokens=False)
        with_target = [t for _, _, t in chunk if t is not None]
        targets = iter(tokenizer.encode_batch(with_target, add_special_tokens=False) if with_target else [])
        for (number, _, target), prompt in zip(chunk, prompts):
            ids = added.wrap(prompt.ids if target is None else prompt.ids + next(targets).ids)
            if eos is not None and ids[-1:] != [eos]:
                ids.append(eos)
            start = prefix + len(prompt.ids)
            builder.add(number, ids, None if target is None else [0] * start + [1] * (len(ids) - start))


def _encode_chat(builder: Builder, tokenizer: Tokenizer, items: Iterator[tuple[int, str, list]]) -> None:
    """Tokenize ``(row_number, text, assistant_spans)`` items in chunks and add them to ``builder``, each token in
    the loss where its characters are the assistant's. The text is encoded as transformers encodes a rendered
    chat: without what the post-processor adds (a chat template writes its own bos)."""
    from ipuft.data.chat import token_mask

    for chunk in _chunks(items):
        encodings = tokenizer.encode_batch([text for _, text, _ in chunk], add_special_tokens=False)
        for (number, _, spans), encoding in zip(chunk, encodings):
            builder.add(number, encoding.ids, token_mask(encoding, spans))


def validation_source(cfg: DictConfig, data: SampleData | TokenDataset | None = None) -> TokenDataset | None:
    """The validation rows: those of ``data.validation_path``, prepared as the training data is, in file
    order, or those ``data.validation_fraction`` held out of ``data`` (the training data); None if neither."""
    if cfg.data.validation_fraction:
        data = data if data is not None else data_source(cfg)
        return data.held_out
    if cfg.data.validation_path is None and cfg.data.validation_split is None:
        return None
    source = tokenizer_source(cfg) if DataFormat(cfg.data.format) is not DataFormat.tokens else None
    if DataFormat(cfg.data.format) is DataFormat.preference:
        from ipuft.data.preference import PreferenceDataset

        tokenizer = None if source is None else load_tokenizer(*source)
        return PreferenceDataset.from_config(cfg, tokenizer, shuffle=False, split=cfg.data.validation_split,
                                             path=cfg.data.validation_path)
    if cfg.data.validation_split is not None:  # another split of data.path's dataset
        return TokenDataset.from_config(cfg, None if source is None else load_tokenizer(*source),
                                        shuffle=False, split=cfg.data.validation_split)
    return TokenDataset.from_config(cfg, None if source is None else load_tokenizer(*source),
                                    path=cfg.data.validation_path, shuffle=False)


def data_source(cfg: DictConfig) -> SampleData | TokenDataset:
    """The training data ``cfg`` asks for: the synthetic :class:`SampleData` when ``data.path`` is null,
    else a :class:`TokenDataset` tokenized by ``data.tokenizer`` (or ``model.hf_checkpoint``'s tokenizer)."""
    if cfg.data.path is None:
        return SampleData(cfg.model.embedding.vocab_size, cfg.model.sequence_length, cfg.data.seed)
    source = tokenizer_source(cfg) if DataFormat(cfg.data.format) is not DataFormat.tokens else None
    if DataFormat(cfg.data.format) is DataFormat.preference:  # pairs: ipuft.data.preference
        from ipuft.data.preference import PreferenceDataset

        dataset = PreferenceDataset.from_config(cfg, None if source is None else load_tokenizer(*source))
    else:
        dataset = TokenDataset.from_config(cfg, None if source is None else load_tokenizer(*source))
    if cfg.data.validation_fraction:
        dataset = dataset.split(cfg.data.validation_fraction, cfg.data.seed)
    return dataset
