"""Real datasets: read rows from a local file, tokenize them, and serve batches as :class:`SampleData` does.

The pipeline is ``read_rows`` (a file → numbered dicts) → :class:`TokenDataset` (dicts → token ids, by
``data.format``, then packed into fixed chunks or kept one example per row) → ``batch(step, ...)``.
Tokenization happens once, up front; the dataset keeps one flat int32 tensor of token ids plus offsets,
never padded copies, and builds each padded row when a batch asks for it.

Which rows make global batch ``step`` depends only on the step and the sampler's seed (see
:class:`Sampler`), so a resumed run that keeps ``training.global_batch_size`` gets the same data by
calling ``batch(step, ...)`` for the steps it has left. Nothing here touches the network.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from array import array
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ipuft.batch import Batch
from ipuft.checkpoint import sha256_file
from ipuft.components import IGNORE_INDEX
from ipuft.config.schema import DataFormat
from ipuft.data import SampleData
from ipuft.errors import DataError, first_line
from ipuft.templates import Template, resolve_template

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

SAMPLE_DATASET = "mnli-sample"
SAMPLE_TOKENIZER = "sample"
READERS = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt")
# Padding of unpacked rows: the id never reaches the loss (its labels are IGNORE_INDEX), and 0 is a valid
# id for every vocabulary, so no tokenizer needs a pad token.
PAD_ID = 0
# Rows are tokenized this many at a time: encode_batch parallelises within a chunk, and the chunk bounds
# the Python strings held at once.
EOS = "<|endoftext|>"  # GPT-J's end-of-text token
ENCODE_CHUNK = 1024


# -- Files ---------------------------------------------------------------------------------------------


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
        from ipuft.checkpoint import find_checkpoint

        return str(find_checkpoint(cfg.model.init_checkpoint)), "model.init_checkpoint"
    return None


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from ``"sample"`` (shipped with ipuft), a directory holding
    ``tokenizer.json``, or the file itself. ``key`` names the config key in error messages."""
    from tokenizers import Tokenizer

    path = tokenizer_path(spec)
    if not path.is_file():
        raise DataError(f"{key}: no tokenizer.json at {path}; give a directory holding tokenizer.json "
                        f"or the file itself")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (the Rust side raises plain Exceptions)
        why = first_line(exc, type(exc).__name__)
        raise DataError(f"{key}: {path} is not a valid tokenizer.json ({why})") from None


def resolve_data_path(path: str) -> Path:
    """The file behind ``data.path``: ``"mnli-sample"`` is the MNLI-style sample shipped with ipuft."""
    if path == SAMPLE_DATASET:
        return Path(str(resources.files("ipuft.sample_data") / "mnli_sample.jsonl"))
    resolved = Path(path)
    if not resolved.is_file():
        raise DataError(f"data.path: {path} does not exist" if not resolved.exists() else
                        f"data.path: {path} is not a regular file")
    return resolved


def read_rows(path: str | Path, name: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row_number, row)`` for each row of a local file, numbered from 1, chosen by the suffix.

    ``.jsonl``/``.json``: one JSON object per line (or one JSON array of objects), numbered by line;
    ``.csv``/``.tsv``: a header row, then records numbered from 1; ``.parquet``: records numbered from 1;
    ``.txt``: each non-empty line is a row ``{"text": line}``, numbered by line. ``name`` (default: the
    path) starts error messages.
    """
    path = Path(path)
    name = name or str(path)
    suffix = path.suffix.lower()
    if suffix not in READERS:
        raise DataError(f"{name}: unsupported file type {suffix or '(no suffix)'!r}; "
                        f"supported: {', '.join(READERS)}")
    if not path.is_file():
        raise DataError(f"data.path: {name} does not exist" if not path.exists() else
                        f"data.path: {name} is not a regular file")
    try:
        yield from _rows(path, name, suffix)
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r} at offset "
                        f"{exc.start} of a read block); save it as UTF-8") from None
    except RecursionError:
        raise DataError(f"{name}: a row nests too deeply to be a training example") from None
    except csv.Error as exc:
        raise DataError(f"{name}: not a valid {suffix[1:].upper()} file ({exc})") from None
    except OSError as exc:
        raise DataError(f"{name} cannot be read ({exc.strerror or exc})") from None


# A row longer than this is no training example (GPT-J's context is 2048 tokens): refused, not loaded.
MAX_ROW_CHARS = 1 << 24


def _rows(path: Path, name: str, suffix: str) -> Iterator[tuple[int, dict[str, Any]]]:
    if suffix in (".jsonl", ".json"):
        yield from _read_json(path, name)
    elif suffix in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8-sig") as f:  # a spreadsheet's BOM is not a column name
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            for number, row in enumerate(reader, 1):
                # A row with more cells than the header gets them under the key None: drop them.
                row.pop(None, None)  # type: ignore[call-overload]
                yield number, row
    elif suffix == ".parquet":
        yield from _read_parquet(path, name)
    else:
        with path.open(encoding="utf-8") as f:
            for number, raw in enumerate(f, 1):
                line = raw.rstrip("\r\n")
                if line.strip():
                    yield number, {"text": line}


def _read_json(path: Path, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8-sig") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        f.seek(0)
        if first == "[":  # one JSON array, as json.dump writes a list of dicts
            try:
                rows = json.load(f)
            except json.JSONDecodeError as exc:
                raise DataError(f"{name} line {exc.lineno}: not valid JSON ({exc.msg})") from None
            for number, row in enumerate(rows, 1):
                yield number, _json_object(row, f"{name} row {number}")
            return
        for number, line in enumerate(iter(lambda: f.readline(MAX_ROW_CHARS + 1), ""), 1):
            if len(line) > MAX_ROW_CHARS:
                raise DataError(f"{name} line {number}: longer than {MAX_ROW_CHARS:,} characters; a row is one "
                                f"training example")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{name} line {number}: not valid JSON ({exc.msg}); expected one JSON "
                                f"object per line") from None
            yield number, _json_object(row, f"{name} line {number}")


def _json_object(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _read_parquet(path: Path, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{name}: reading .parquet files needs pyarrow; pip install ipuft[parquet]") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 (pyarrow's ArrowInvalid and friends)
        raise DataError(f"{name}: not a readable parquet file ({str(exc).splitlines()[0]})") from None
    number = 0
    for record_batch in table.iter_batches():
        for row in record_batch.to_pylist():
            number += 1
            yield number, row


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
    """Tokenized rows of ``sequence_length + 1`` tokens, served as :class:`~ipuft.engine.Batch` objects.

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
        cache = TokenCache.for_config(cfg, resolved, tokenizer) if data.cache else None
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
                                         for n, row in rows))
        else:
            template = resolve_template(data.template)
            _encode(builder, tokenizer, ((n, *_rendered(template, row, f"{name} row {n}")) for n, row in rows))
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


CACHE_VERSION = 1  # bump when tokenization or packing changes what a cache entry holds


def cache_root() -> Path:
    """Where tokenized datasets are cached: ``IPUFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ipuft``, else
    ``~/.cache/ipuft``."""
    if os.environ.get("IPUFT_CACHE_DIR"):
        return Path(os.environ["IPUFT_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ipuft"


class TokenCache:
    """A tokenized dataset kept as ``.npy`` files, memory-mapped when read again: keyed by the data file's
    SHA-256, the tokenizer's, and every setting that shapes the tokens (format, template, text field,
    packing, sequence length), so that a second run with the same inputs starts without tokenizing.

    The cache is only an accelerator: an entry that is missing, unreadable or inconsistent is rebuilt,
    never trusted, and entries are written to a temporary directory and renamed into place.
    """

    FILES = ("tokens", "offsets", "target_starts")

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def for_config(cls, cfg: DictConfig, path: Path, tokenizer: Tokenizer | None) -> TokenCache:
        data = cfg.data
        key = {"version": CACHE_VERSION, "data": sha256_file(path), "format": DataFormat(data.format).value,
               "template": data.template, "text_field": data.text_field, "packing": bool(data.packing),
               "sequence_length": cfg.model.sequence_length,
               "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest() if tokenizer else None}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return cls(cache_root() / "tokens" / digest)

    def load(self, name: str, vocab_size: int) -> tuple[torch.Tensor, ...] | None:
        """The cached ``(tokens, offsets, target_starts)`` (offsets None when packed), or None on a miss."""
        import numpy as np

        try:
            arrays = {f: np.load(self.directory / f"{f}.npy", mmap_mode="r", allow_pickle=False)
                      for f in self.FILES if (self.directory / f"{f}.npy").exists()}
        except (OSError, ValueError):
            return None
        tokens = arrays.get("tokens")
        if tokens is None or tokens.dtype != np.int32 or tokens.ndim != 1 or not len(tokens):
            return None
        if int(tokens.max()) >= vocab_size or int(tokens.min()) < 0:
            return None
        offsets, starts = arrays.get("offsets"), arrays.get("target_starts")
        if (offsets is None) != (starts is None):
            return None
        if offsets is not None and not (offsets.dtype == starts.dtype == np.int64 and len(offsets) == len(starts) + 1
                                        and offsets[0] == 0 and offsets[-1] == len(tokens)):
            return None
        with warnings.catch_warnings():  # read-only memory maps: the dataset never writes to them
            warnings.simplefilter("ignore", UserWarning)
            return tuple(None if a is None else torch.from_numpy(a) for a in (tokens, offsets, starts))

    def store(self, dataset: TokenDataset) -> None:
        """Keep ``dataset``'s arrays; a failure to write (a full or read-only disk) only costs the cache."""
        import numpy as np

        tmp = None
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory.parent))
            np.save(tmp / "tokens.npy", dataset.tokens.numpy())
            if dataset.offsets is not None:
                np.save(tmp / "offsets.npy", dataset.offsets.numpy())
                np.save(tmp / "target_starts.npy", dataset.target_starts.numpy())
            if self.directory.exists():  # an entry load() did not trust
                shutil.rmtree(self.directory)
            os.replace(tmp, self.directory)
        except OSError:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


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


def _encode(builder: _Builder, tokenizer: Tokenizer, items: Iterator[tuple[int, str, str | None]]) -> None:
    """Tokenize ``(row_number, prompt, target)`` items in chunks and add them to ``builder``.

    Prompt and target are tokenized separately and concatenated, so the target starts at an exact token
    (a BPE merge across the boundary cannot blur it). Special tokens written in the text, such as
    ``<|endoftext|>``, become their single ids; none are added that the text does not contain.
    """
    def flush(chunk: list[tuple[int, str, str | None]]) -> None:
        prompts = tokenizer.encode_batch([p for _, p, _ in chunk], add_special_tokens=False)
        with_target = [t for _, _, t in chunk if t is not None]
        targets = iter(tokenizer.encode_batch(with_target, add_special_tokens=False) if with_target else [])
        for (number, _, target), prompt in zip(chunk, prompts):
            ids = prompt.ids
            if target is None:
                builder.add(number, ids, 0)
            else:
                builder.add(number, ids + next(targets).ids, len(ids))

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
