"""The one reader of the files ipuft did not write itself: a config.json, a weight index, a hub cache's
``refs/main``, kernels.json, a tokenizer's and a model's small files, a YAML config, a prompts file.

Each is untrusted and may be anything a path can name: a link to a device (``/dev/zero`` reads without end and
says its size is 0), a FIFO (which blocks an ``open`` until someone writes), a directory. So a file is taken
only if it is a regular file, checked twice: by ``stat`` before it is opened (a device or FIFO is never
opened), and by ``fstat`` on what was opened (opened without blocking, so a FIFO swapped in between cannot
hang the reader); and its size is bounded by reading at most one byte past the limit, never by trusting
``st_size``. A file that fails is one line naming it, of the error type the caller gives.

Large files are not read here but opened through :func:`open_regular` (data files, streamed) or checked with
:func:`require_regular` before a library maps them (safetensors shards).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO

from ipuft.errors import CheckpointError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: Path, mode: int, where: str, error: type[Exception]) -> Exception:
    link = "a link to " if path.is_symlink() else ""
    return error(f"{where} is {link}{_kind(mode)}, not a regular file")


def open_regular(path: str | Path, where: str, error: type[Exception] = CheckpointError) -> IO[bytes]:
    """``path`` open for reading in binary, once it is known to be a regular file (following links); one
    ``error`` line naming ``where`` if it is absent, unreadable or anything else (never blocking on a FIFO)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode, where, error)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{where} does not exist") from None
    except OSError as exc:
        raise error(f"{where} cannot be read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped between the stat and the open
            raise _refuse(path, mode, where, error)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def require_regular(path: str | Path, where: str, error: type[Exception] = CheckpointError) -> None:
    """Check that ``path`` is a regular file that can be opened, before a library that opens or maps it by
    name (safetensors, ``torch.load``) gets it: a FIFO would block it, a device would map garbage."""
    open_regular(path, where, error).close()


def read_bounded(path: str | Path, limit: int, where: str, error: type[Exception] = CheckpointError,
                 hint: str = "") -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them: a larger file is one ``error`` line
    naming ``where`` (followed by ``hint``, what such a file should be), as is anything :func:`open_regular`
    refuses. The size is what was read (at most ``limit + 1`` bytes), not what the file system says."""
    with open_regular(path, where, error) as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise error(f"{where} cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{where} is larger than {limit} bytes{hint}")
    return data


def read_text(path: str | Path, limit: int, where: str, error: type[Exception] = CheckpointError,
              hint: str = "") -> str:
    """:func:`read_bounded`, decoded as UTF-8 (a file that is not is one ``error`` line)."""
    try:
        return read_bounded(path, limit, where, error, hint).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r} at offset "
                    f"{exc.start})") from None


def read_json(path: str | Path, limit: int, where: str, error: type[Exception] = CheckpointError,
              hint: str = "") -> object:
    """The JSON value in regular file ``path`` (:func:`read_text`), parsed as data; one ``error`` line if it is
    not JSON (or nests too deeply to parse)."""
    text = read_text(path, limit, where, error, hint)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise error(f"{where} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
