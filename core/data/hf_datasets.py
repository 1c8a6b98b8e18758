"""Hugging Face datasets as ``data.path``, read through the ``datasets`` library (the optional ``ipuft[datasets]``
extra), never from the network:

- a directory written by ``Dataset.save_to_disk`` (its ``state.json``) or ``DatasetDict.save_to_disk`` (its
  ``dataset_dict.json``: ``data.split`` picks one);
- a directory of Parquet or Arrow shards, its splits named as the Hub names them (``train-00000.parquet``,
  ``data/test/...``; shards without a split name are ``train``);
- a dataset's name (``owner/name``) that ``datasets`` finds in its local cache (``HF_DATASETS_CACHE``), with
  ``data.subset`` and ``data.split``; the library runs offline, so a name it has not cached is one line.

Rows are served in order from the dataset's memory-mapped Arrow files, one at a time, as a file's are
(:func:`ipuft.data.files.read_rows`), numbered from 1 for error messages; the token cache keys a dataset by its
fingerprint and split (:func:`digest`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipuft.errors import DataError
from ipuft.paths import cache_root

SHARDS = {".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class DatasetSource:
    """``data.path`` naming a Hugging Face dataset (a directory, or a cached dataset's name), with its split
    and subset."""

    location: str
    split: str = "train"
    subset: str | None = None

    def __str__(self) -> str:
        return self.location + (f" ({self.subset})" if self.subset else "") + f" [{self.split}]"


def _library():
    # Offline, always: ipuft never downloads. Set before the library reads its configuration, and after.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError("data.path: reading a Hugging Face dataset needs the datasets library; "
                        "pip install ipuft[datasets]") from None
    # The flag the library reads once imported (HF_HUB_OFFLINE in recent releases, HF_DATASETS_OFFLINE in older
    # ones): an import ahead of this one read the environment without ours, and would ask the Hub, with retries.
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _pick(datasets, loaded, source: DatasetSource):
    """The split ``source`` names of a ``DatasetDict``; a lone ``Dataset`` is its own only split."""
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    splits = list(loaded.keys())
    if source.split not in splits:
        raise DataError(f"data.split: {source.location} has no split {source.split!r}; its splits: "
                        f"{', '.join(splits)}")
    return loaded[source.split]


@functools.lru_cache(maxsize=8)
def load(source: DatasetSource):
    """The dataset ``source`` names, one split of it, memory-mapped (a one-line :class:`DataError` otherwise);
    loaded once per process (the token cache's key and the rows read the same one)."""
    datasets = _library()
    path = Path(source.location)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            if source.subset is not None:
                raise DataError(f"data.subset: {path} is a dataset saved with save_to_disk, which has no subsets; "
                                f"set data.subset=null")
            try:
                return _pick(datasets, datasets.load_from_disk(str(path)), source)
            except DataError:
                raise
            except Exception as exc:  # noqa: BLE001 (the library's errors, a damaged directory's)
                raise DataError(f"data.path: {path} is not a readable saved dataset ({_first_line(exc)})") from None
        return _shards(datasets, path, source)
    try:
        loaded = datasets.load_dataset(source.location, source.subset)
    except Exception as exc:  # noqa: BLE001 (not cached, no such subset, a damaged cache)
        subsets = _cached_subsets(datasets, source.location)
        if subsets and source.subset is None and len(subsets) > 1:
            raise DataError(f"data.subset: {source.location} has several subsets in the local datasets cache; "
                            f"set data.subset to one of: {', '.join(subsets)}") from None
        if subsets and source.subset is not None and source.subset not in subsets:
            raise DataError(f"data.subset: {source.location} has no subset {source.subset!r} in the local datasets "
                            f"cache; its subsets there: {', '.join(subsets)}") from None
        missing = f"{source.location} is neither a file nor a directory"
        raise DataError(f"data.path: {missing}, and the local datasets cache cannot give it offline "
                        f"({_first_line(exc)}); ipuft never downloads: load it once with datasets.load_dataset "
                        f"where the network is reachable, or give a file or a directory") from None
    return _pick(datasets, loaded, source)


def _cached_subsets(datasets, name: str) -> list[str]:
    """The subsets of ``name`` in the local datasets cache, as the library lays it out
    (``owner___name/subset/version/hash/``); none where the name is not there."""
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser() / "___".join([*parts[:-1],
                                                                              camelcase_to_snakecase(parts[-1])])
    return sorted({p.parts[-3] for p in root.glob("*/*/*") if p.is_dir()})


def _shards(datasets, path: Path, source: DatasetSource):
    """A directory of Parquet or Arrow shards, its splits by the Hub's file naming."""
    if source.subset is not None:
        raise DataError(f"data.subset: {path} is a directory of shards, which has no subsets; set data.subset=null")
    kinds = {SHARDS[p.suffix.lower()] for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SHARDS}
    if len(kinds) != 1:
        raise DataError(f"data.path: {path} is a directory, but neither a saved dataset (no state.json or "
                        f"dataset_dict.json) nor a directory of " +
                        ("Parquet or Arrow shards" if not kinds else "shards of one kind (it mixes .parquet and "
                                                                     ".arrow)"))
    from datasets.data_files import get_data_patterns

    try:
        patterns = [str(split) for split in get_data_patterns(str(path))]
    except Exception as exc:  # noqa: BLE001 (EmptyDatasetError and the like)
        raise DataError(f"data.path: {path}: no shards the datasets library can read ({_first_line(exc)})") from None
    if source.split not in patterns:
        raise DataError(f"data.split: {path} has no split {source.split!r}; its splits: {', '.join(patterns)}")
    try:
        return datasets.load_dataset(kinds.pop(), data_dir=str(path), split=source.split,
                                     cache_dir=str(cache_root() / "datasets"))
    except Exception as exc:  # noqa: BLE001 (a damaged shard)
        raise DataError(f"data.path: {path}: its shards cannot be read ({_first_line(exc)})") from None


def read_dataset(source: DatasetSource) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row_number, row)`` of each row of ``source``'s split, in order, numbered from 1."""
    yield from enumerate(load(source), 1)


def digest(source: DatasetSource) -> str:
    """What the token cache keys ``source`` by: its split's fingerprint (the library's hash of its content and
    history), with the split and subset."""
    fingerprint = getattr(load(source), "_fingerprint", None)
    if not fingerprint:
        raise DataError(f"data.path: {source} has no fingerprint to key the token cache by; set data.cache=false")
    return hashlib.sha256(repr(("hf-dataset", fingerprint, source.split, source.subset)).encode()).hexdigest()
