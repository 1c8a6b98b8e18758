"""The token cache: a tokenized dataset kept as memory-mapped ``.npy`` files under ``IPUFT_CACHE_DIR`` (else
``~/.cache/ipuft``), so that a second run with the same inputs starts at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ipuft.config.schema import DataFormat
from ipuft.data.builder import Arrays
from ipuft.data.hf_datasets import DatasetSource
from ipuft.data.hf_datasets import digest as dataset_digest
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import sha256_file
from ipuft.io.files import require_regular
from ipuft.paths import cache_root

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

    from ipuft.data.tokens import TokenDataset


CACHE_VERSION = 3  # bump when tokenization or packing changes what a cache entry holds


class TokenCache:
    """A tokenized dataset kept as ``.npy`` files, memory-mapped when read again: keyed by the data file's
    SHA-256, the tokenizer's, and every setting that shapes the tokens (format, template, text field,
    packing, sequence length, the chat template's text), so that a second run with the same inputs starts without
    tokenizing.

    The cache is only an accelerator: an entry that is missing, unreadable or inconsistent is rebuilt,
    never trusted, and entries are written to a temporary directory and renamed into place.
    """

    FILES = ("tokens", "mask", "offsets", "rows")

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def for_config(cls, cfg: DictConfig, path: Path | DatasetSource, tokenizer: Tokenizer | None,
                   added: tuple = ()) -> TokenCache:
        """The entry of ``path`` as ``cfg`` and ``tokenizer`` tokenize it; ``added``: what else shapes the tokens
        that the keys alone do not fix: the ids the encoding adds around each example (the post-processor's, and
        the eos, from tokenizer_config.json or the model), the chat template's text, the layout, whether masks are
        kept, the truncation."""
        data = cfg.data
        fields = {k: data.get(k) for k in ("instruction_template", "prompt_field", "input_field", "response_field",
                                           "messages_field")}
        source = dataset_digest(path) if isinstance(path, DatasetSource) else sha256_file(path)
        key = {"version": CACHE_VERSION, "data": source, "format": DataFormat(data.format).value,
               "template": data.template, "text_field": data.text_field, "packing": bool(data.packing), **fields,
               "sequence_length": cfg.model.sequence_length, "added": json.loads(json.dumps(added)),
               "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest() if tokenizer else None}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return cls(cache_root() / "tokens" / digest)

    def load(self, name: str, vocab_size: int) -> Arrays | None:
        """The cached arrays (see :class:`~ipuft.data.builder.Arrays`), or None on a miss or an entry that does
        not check out."""
        import numpy as np

        arrays = {}
        try:
            for f in self.FILES:
                file = self.directory / f"{f}.npy"
                if file.exists() or file.is_symlink():
                    require_regular(file, str(file))  # a FIFO would block np.load, a device map garbage
                    arrays[f] = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, CheckpointError):
            return None
        tokens, mask, offsets, rows = (arrays.get(f) for f in self.FILES)
        if tokens is None or tokens.dtype != np.int32 or tokens.ndim != 1 or not len(tokens):
            return None
        if int(tokens.max()) >= vocab_size or int(tokens.min()) < 0:
            return None
        if mask is not None and not (mask.dtype == np.uint8 and mask.shape == tokens.shape and int(mask.max()) <= 1):
            return None
        if offsets is not None and not (offsets.dtype == np.int64 and offsets.ndim == 1 and len(offsets) >= 2
                                        and offsets[0] == 0 and offsets[-1] == len(tokens)
                                        and bool((np.diff(offsets) > 0).all())):
            return None
        if rows is not None and not (offsets is not None and rows.dtype == np.int64 and rows.ndim == 1
                                     and len(rows) >= 2 and rows[0] == 0 and rows[-1] == len(offsets) - 1
                                     and bool((np.diff(rows) > 0).all())):
            return None
        with warnings.catch_warnings():  # read-only memory maps: the dataset never writes to them
            warnings.simplefilter("ignore", UserWarning)
            return Arrays(*(None if a is None else torch.from_numpy(a) for a in (tokens, mask, offsets, rows)))

    def store(self, dataset: TokenDataset) -> None:
        """Keep ``dataset``'s arrays; a failure to write (a full or read-only disk) only costs the cache."""
        import numpy as np

        tmp = None
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory.parent))
            for f in self.FILES:
                array = getattr(dataset.arrays, f)
                if array is not None:
                    np.save(tmp / f"{f}.npy", array.numpy())
            if self.directory.exists():  # an entry load() did not trust
                shutil.rmtree(self.directory)
            os.replace(tmp, self.directory)
        except OSError:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
