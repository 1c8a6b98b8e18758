"""Rows from local files: ``.jsonl``/``.json``, ``.csv``/``.tsv``, ``.parquet`` and ``.txt``, each row a dict,
numbered for error messages. Every file is untrusted: a wrong type, an oversized row or bytes that are not
UTF-8 are one :class:`~ipuft.errors.DataError` line naming the file and row."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from ipuft.data.hf_datasets import DatasetSource, read_dataset
from ipuft.errors import DataError
from ipuft.io.files import open_regular

SAMPLE_DATASET = "mnli-sample"
READERS = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt")


def resolve_data_path(path: str, split: str = "train", subset: str | None = None) -> Path | DatasetSource:
    """The file behind ``data.path`` (``"mnli-sample"`` is the MNLI-style sample shipped with ipuft), or the Hugging
    Face dataset it names (:mod:`ipuft.data.hf_datasets`): a directory, or a name that is no path here, with no
    data file's suffix (``dir.jsonl/`` stays a file's name that is not a regular file), with its ``split`` and
    ``subset``."""
    if path == SAMPLE_DATASET:
        return Path(str(resources.files("ipuft.sample_data") / "mnli_sample.jsonl"))
    resolved = Path(path)
    if resolved.suffix.lower() not in READERS and (resolved.is_dir() or not resolved.exists()):
        return DatasetSource(path, split, subset)
    if not resolved.is_file():
        raise DataError(f"data.path: {path} does not exist" if not resolved.exists() else
                        f"data.path: {path} is not a regular file")
    return resolved


def read_rows(path: str | Path | DatasetSource, name: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row_number, row)`` for each row of a local file, numbered from 1, chosen by the suffix (or of a Hugging
    Face dataset's split, :func:`ipuft.data.hf_datasets.read_dataset`).

    ``.jsonl``/``.json``: one JSON object per line (or one JSON array of objects), numbered by line;
    ``.csv``/``.tsv``: a header row, then records numbered from 1; ``.parquet``: records numbered from 1;
    ``.txt``: each non-empty line is a row ``{"text": line}``, numbered by line. ``name`` (default: the
    path) starts error messages.
    """
    if isinstance(path, DatasetSource):
        yield from read_dataset(path)
        return
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
        with _open_text(path, name, "utf-8-sig", newline="") as f:  # a spreadsheet's BOM is not a column name
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            for number, row in enumerate(reader, 1):
                # A row with more cells than the header gets them under the key None: drop them.
                row.pop(None, None)  # type: ignore[call-overload]
                yield number, row
    elif suffix == ".parquet":
        yield from _read_parquet(path, name)
    else:
        with _open_text(path, name, "utf-8") as f:
            for number, raw in enumerate(f, 1):
                line = raw.rstrip("\r\n")
                if line.strip():
                    yield number, {"text": line}


def _open_text(path: Path, name: str, encoding: str, newline: str | None = None) -> io.TextIOWrapper:
    """``path`` open as text, once the opened file is known to be a regular one (:mod:`ipuft.io.files`: a FIFO
    swapped in after :func:`read_rows`' check is refused, not waited on)."""
    return io.TextIOWrapper(open_regular(path, name, DataError), encoding=encoding, newline=newline)


def _read_json(path: Path, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_text(path, name, "utf-8-sig") as f:
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
    """A JSON row: an object whose keys and text values are Unicode text (JSON's ``\\uXXXX`` escapes can spell a
    lone UTF-16 surrogate, which no tokenizer takes)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, value in row.items():
        for text, what in ((key, "a field name"), (value, f"field {key!r}")):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise DataError(f"{where}: {what} holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
                                    f"{exc.start}), which is not Unicode text; a JSON \\uD800-\\uDFFF escape must "
                                    f"pair a high surrogate with a low one") from None
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
