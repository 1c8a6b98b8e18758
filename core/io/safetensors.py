"""safetensors files streamed one tensor at a time, hashed as their bytes pass.

safetensors' own writers take every tensor of a file at once, and its readers say nothing about whether the
bytes are the ones a manifest vouches for. A checkpoint of a model larger than memory needs both the other
way round: :class:`SafetensorsWriter` computes the header from the tensors' names, dtypes and shapes (known
before any is gathered), then appends each tensor's bytes as it comes, updating a SHA-256 with every byte it
writes; :class:`SafetensorsReader` checks the header of an untrusted file, reads tensors in any order, and
hashes each byte once as a cursor passes it, so that reading a file front to back is one pass that also
verifies it. The format: an 8-byte little-endian header length, the JSON header (``__metadata__`` and, per
tensor, ``dtype``, ``shape`` and ``data_offsets`` into the data), padded with spaces to a multiple of 8,
then the tensors' raw little-endian bytes, back to back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ipuft.components import VariableSpec
from ipuft.errors import CheckpointError
from ipuft.io.files import open_regular

_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip
# torch's dtype → safetensors' name for it (the unsigned and 8-bit float types where this torch has them).
DTYPE_NAMES = {getattr(torch, t): n for t, n in _NAMES.items() if hasattr(torch, t)}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
HEADER_LIMIT = 100_000_000  # bytes; safetensors' own bound (a header of 10^4 tensors is about 1 MB)
_BLOCK = 1 << 22  # bytes hashed per read when skipping ahead

if sys.byteorder != "little":  # the format is little-endian, and tensors are written as they lie in memory
    raise ImportError("ipuft writes safetensors files from memory as is, which needs a little-endian machine")


def _raw(tensor: torch.Tensor):
    """The bytes of a CPU tensor, without a copy when it is contiguous (a numpy view, which file writes and
    hashlib take as a buffer)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


class SafetensorsWriter:
    """Write a safetensors file whose tensors (``specs``: names, shapes, dtypes, in file order) are known up
    front, appending each tensor's bytes as :meth:`write` is handed it, in that order; :meth:`close` fsyncs
    and returns the SHA-256 of every byte written."""

    def __init__(self, path: Path, specs: Sequence[VariableSpec], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for spec in self.specs:
            if spec.name in header:
                raise ValueError(f"{self.path}: tensor {spec.name} is listed twice")
            size = math.prod(spec.shape) * spec.dtype.itemsize
            header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.size = 8 + len(text) + offset
        self._digest = hashlib.sha256()
        self._next = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close() or abort())
        self._put(struct.pack("<Q", len(text)) + text)

    def _put(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the header, which must be ``name`` with its header's dtype and shape."""
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: {name} is beyond the {len(self.specs)} tensors of the header")
        spec = self.specs[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"{self.path}: tensor {self._next} is {spec.name} {spec.dtype} {tuple(spec.shape)} "
                             f"in the header, not {name} {tensor.dtype} {tuple(tensor.shape)}")
        self._put(_raw(tensor.cpu()))
        self._next += 1

    def close(self) -> str:
        """Flush and fsync the file, every tensor written; return its SHA-256 hex digest."""
        if self._next != len(self.specs):
            self.abort()
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensors of the header were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._digest.hexdigest()

    def abort(self) -> None:
        """Close the file unfinished (the caller removes it)."""
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its dtype, shape, and where its bytes lie (absolute offsets)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsReader:
    """Read the tensors of an untrusted safetensors file one at a time, verifying it as it is read.

    The header is checked when the file is opened: its length is bounded and inside the file, it is a JSON
    object, every dtype is known, every shape matches its byte count, and the tensors' bytes lie back to
    back from the end of the header to the end of the file. Every byte is hashed exactly once, as a cursor
    passes it: a tensor at or ahead of the cursor is read there (the bytes skipped on the way are hashed as
    they go by), one behind it is read again with a seek and not hashed again. :meth:`finish` hashes what is
    left and compares the digest with ``digest``. ``where`` names the file in errors.
    """

    def __init__(self, path: Path, where: str, digest: str | None = None) -> None:
        self.path = Path(path)
        self.where = where
        self.expected = digest
        self.hashed = 0  # bytes hashed so far; the file's size once finished
        self._failed: CheckpointError | None = None  # set by a finish() that found the file altered
        self._finished = False
        self._digest = hashlib.sha256()
        self._buffer = bytearray(_BLOCK)
        self._file = open_regular(self.path, where)  # closed by finish() or close(); never a FIFO or device
        self.size = os.fstat(self._file.fileno()).st_size
        try:
            self.entries, self.metadata = self._header()
        except BaseException:
            self._file.close()
            raise
        self._cursor = self._start

    def _damaged(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.where} is damaged ({problem})")

    def _header(self) -> tuple[dict[str, Entry], dict[str, str]]:
        if self.size < 8:
            raise self._damaged(f"{self.size} bytes, too short for a safetensors header: truncated")
        (length,) = struct.unpack("<Q", self._read(8))
        if length > HEADER_LIMIT:
            raise self._damaged(f"its header length {length} exceeds {HEADER_LIMIT} bytes")
        if 8 + length > self.size:
            raise self._damaged(f"its header needs {8 + length} bytes, the file holds {self.size}: truncated")
        raw = self._read(length)
        self._digest.update(struct.pack("<Q", length))
        self._digest.update(raw)
        self.hashed = self._start = 8 + length
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise self._damaged(f"its header is not JSON: {type(exc).__name__}") from None
        if not isinstance(header, dict):
            raise self._damaged("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise self._damaged("its __metadata__ is not an object of strings")
        entries = {name: self._entry(name, info) for name, info in header.items()}
        position = self._start
        for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
            if entry.begin != position:
                raise self._damaged(f"the bytes of {name[:80]!r} do not follow those before it")
            position = entry.end
        if position != self.size:
            raise self._damaged(f"its tensors end at byte {position}, the file holds {self.size}"
                                + (": truncated" if position > self.size else ""))
        return entries, metadata

    def _entry(self, name: str, info) -> Entry:
        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62

        where = f"tensor {name[:80]!r}"
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)):
            raise self._damaged(f"{where} lacks dtype, shape or data_offsets")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise self._damaged(f"{where} has an unknown dtype {str(info['dtype'])[:20]!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= 16 and all(integer(d) for d in shape)):
            raise self._damaged(f"{where}: its shape is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(integer(o) for o in offsets)):
            raise self._damaged(f"{where}: its data_offsets are not two byte offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise self._damaged(f"{where}: shape {tuple(shape)} of {info['dtype']} is not its {end - begin} bytes")
        return Entry(dtype, tuple(shape), self._start + begin, self._start + end)

    def _read(self, size: int) -> bytes:
        data = self._file.read(size)
        if len(data) != size:
            raise self._damaged(f"it ended after {self._file.tell()} bytes: truncated")
        return data

    def _read_into(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = self._file.readinto(view[done:])
            if not n:
                raise self._damaged(f"it ended after {self._file.tell()} bytes: truncated")
            done += n

    def _hash_to(self, position: int) -> None:
        """Hash the bytes from the cursor up to ``position``, reading them in blocks."""
        if position <= self._cursor:
            return
        self._file.seek(self._cursor)
        view = memoryview(self._buffer)
        while self._cursor < position:
            chunk = view[: min(len(view), position - self._cursor)]
            self._read_into(chunk)
            self._digest.update(chunk)
            self._cursor += len(chunk)
            self.hashed += len(chunk)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` (which must be in the header), read from the file into a new CPU tensor, or into
        ``out`` (a contiguous CPU tensor of its dtype and shape), which saves a copy when the tensor has a
        home already."""
        if self._failed is not None:
            raise self._failed
        entry = self.entries[name]
        if out is None:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
        elif (out.dtype, tuple(out.shape), out.device.type, out.is_contiguous()) != (entry.dtype, entry.shape, "cpu",
                                                                                      True):
            raise ValueError(f"{self.where}: {name} is {entry.dtype} {entry.shape}; cannot read it into a "
                             f"{out.dtype} {tuple(out.shape)} tensor on {out.device}")
        else:
            tensor = out
        view = memoryview(_raw(tensor))
        if self._file.closed:  # after finish(): every byte is hashed, so any read is a read again
            self._file = open(self.path, "rb")  # noqa: SIM115
        ahead = entry.begin >= self._cursor
        self._hash_to(entry.begin)
        self._file.seek(entry.begin)
        self._read_into(view)
        if ahead:
            self._digest.update(view)
            self._cursor = entry.end
            self.hashed += len(view)
        return tensor

    def finish(self) -> None:
        """Hash the rest of the file, close it, and raise if its digest is not ``digest`` (again on every later
        call, and on every later :meth:`get`)."""
        if self._failed is not None:
            raise self._failed
        if self._finished:
            return
        try:
            self._hash_to(self.size)
        finally:
            self._file.close()
        self._finished = True
        if self.expected is not None and self._digest.hexdigest() != self.expected:
            self._failed = CheckpointError(f"{self.where} does not match its checksum (corrupted)")
            raise self._failed

    def close(self) -> None:
        self._file.close()
