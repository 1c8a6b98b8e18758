"""Activation entries on disk (``execution.activation_offload=disk``): each layer boundary's ``x[n][mb]`` that
a later forward reads is written to a file of its own in the forward and read back once in the backward.

A writer thread writes each entry as it is made (raw bytes, ``fdatasync`` then ``POSIX_FADV_DONTNEED``, so the
page cache does not keep what is on disk and the cgroup's memory does not grow with it); a reader thread reads
the entries in the order the backward consumes them (rows from the last down, micro-batches in order), at most
one row's worth ahead: while layer ``n``'s backward runs, layer ``n-1``'s entries are read. Read files are
dropped from the page cache and deleted at once. The writer waits when one row's worth of entries is queued,
so host memory never holds more than two rows of entries besides ``dx`` (:func:`ipuft.plan.memory.spill_host_bytes`).

Each rank's files live in a directory of its own, ``<spill_dir>/ipuft-spill-<rank>-<random>`` (made with
``mkdtemp``, its entries with ``O_EXCL``), locked (``flock``) for the engine's life; a directory a killed run
left is recognised by its lock being free and loses only the files this module names. A full disk or a file
that vanished is one :class:`~ipuft.errors.SpillError` line naming the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from queue import Queue

import torch

from ipuft.errors import SpillError
from ipuft.program import Op, OpActivations

PREFIX = "ipuft-spill-"
LOCK = ".lock"
ENTRY = re.compile(r"x-\d+-\d+")  # the only names a spill directory's cleaning removes (and LOCK)
Key = tuple[str, int, int]  # ("x", row, micro-batch)


def spill_root(spill_dir: str | None, run_dir: str | Path | None) -> Path:
    """Where ``activation_offload=disk`` spills activations: ``execution.spill_dir``, else the run directory's
    ``spill/`` (rank 0's, once the run has made it; another rank's, ``output_dir``), else the system's temporary
    directory's ``ipuft-spill/``. The one place this is decided (the engine and the training run ask it)."""
    if spill_dir is not None:
        return Path(spill_dir)
    if run_dir is not None:
        return Path(run_dir) / "spill"
    return Path(tempfile.gettempdir()) / "ipuft-spill"


def spilled_rows(activations: Iterable[dict[Op, OpActivations]]) -> set[int]:
    """The rows of ``x`` spilled to disk: those a forward op reads (and the unit's backward reads again); the
    head's input, read once right after it is made, stays in host memory."""
    return {io.read("x")[1] for ops in activations for op, io in ops.items()
            if op is Op.FORWARD and io.read("x") is not None}


def remove_stale(root: Path) -> int:
    """Remove the spill directories under ``root`` that no live engine holds (their lock is free): only the
    files this module names, and the directory when that empties it. Returns how many were removed."""
    removed = 0
    for entry in os.scandir(root):
        if not (entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock: not ours, or one being made this instant
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live run's
        try:
            _remove_own_files(Path(entry.path))
            removed += 1
        finally:
            os.close(fd)
    return removed


def _remove_own_files(directory: Path) -> None:
    for child in os.scandir(directory):
        if (ENTRY.fullmatch(child.name) or child.name == LOCK) and child.is_file(follow_symlinks=False):
            os.unlink(child.path)
    with contextlib.suppress(OSError):  # something else is in it: not ours to remove
        os.rmdir(directory)


class SpillFiles:
    """One rank's spilled entries: written and read by two threads, ``window`` entries ahead at most."""

    def __init__(self, root: Path, rank: int, step_bytes: int, window: int, ranks_here: int = 1,
                 pin: bool = False) -> None:
        """Vet ``root`` (a writable directory, made if missing), remove stale spills there, check it has room
        for ``step_bytes`` (each of this machine's ``ranks_here`` ranks' worth) and make this rank's directory.
        ``pin``: read into pinned memory (CUDA), for asynchronous copies to the device."""
        from ipuft.units import format_bytes

        self.root, self.step_bytes, self.window, self.pin = Path(root), step_bytes, max(1, window), pin
        self._format = format_bytes
        if self.root.exists() and not self.root.is_dir():
            raise SpillError(f"execution.spill_dir: {self.root} exists and is not a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale(self.root)
            free = shutil.disk_usage(self.root).free
            if free < step_bytes * ranks_here:
                raise SpillError(f"execution.spill_dir: {self.root} has {format_bytes(free)} free, but a step "
                                 f"spills {format_bytes(step_bytes * ranks_here)} of activations there; free "
                                 f"space or set execution.spill_dir to a larger disk")
            self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{rank}-", dir=self.root))
            self._lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise SpillError(f"execution.spill_dir: {self.root} cannot be written ({exc.strerror or exc}); "
                             f"give a writable directory") from None
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.written = self.read = 0  # bytes this step
        self._error: SpillError | None = None
        self._cond = threading.Condition()
        self._on_disk: set[Key] = set()  # written and synced
        self._sizes: dict[Key, tuple[torch.Size, torch.dtype]] = {}
        self._ready: dict[Key, torch.Tensor] = {}
        self._order: list[Key] = []  # what the reader reads next, in order
        self._reading: Key | None = None  # what it reads now
        self._held = 0  # entries read and not yet done with (the window)
        self._pending = 0  # bytes queued for writing
        self._writes: Queue = Queue(maxsize=self.window)
        self._closed = False
        self._threads = [threading.Thread(target=self._writer, daemon=True, name="ipuft-spill-writer"),
                         threading.Thread(target=self._reader, daemon=True, name="ipuft-spill-reader")]
        for t in self._threads:
            t.start()

    # ---- the main thread's side ----

    def put(self, key: Key, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Write ``tensor`` (host memory, contiguous) as ``key``; the writer holds it until it is on disk."""
        self.check()
        with self._cond:
            self._sizes[key] = (tensor.shape, tensor.dtype)
            self._pending += tensor.numel() * tensor.element_size()
        self._writes.put((key, tensor, ready))

    def pending_bytes(self) -> int:
        """Bytes held for writing or read ahead and not yet taken (host memory besides the buffers' own)."""
        with self._cond:
            return self._pending + sum(t.numel() * t.element_size() for t in self._ready.values())

    def schedule(self, keys: list[Key]) -> None:
        """Read ``keys`` back in this order, ahead of :meth:`take`."""
        with self._cond:
            self._order.extend(keys)
            self._cond.notify_all()

    def take(self, key: Key) -> torch.Tensor:
        """``key``'s entry, read (by the reader, waiting for it; or here, if the reader is not about to read
        it); its file is gone. Call :meth:`done` when finished with it."""
        with self._cond:
            self._raise()
            if key not in self._ready and key != self._reading:
                if key not in self._sizes:
                    raise KeyError(f"{key} was not spilled")
                if key in self._order and (key != self._order[0] or self._held >= self.window):
                    self._order.remove(key)
                if key not in self._order:  # not next in line: read it here, waiting for its write first
                    self._held += 1
                    self._cond.wait_for(lambda: key in self._on_disk or self._error is not None)
                    self._raise()
                    try:
                        return self._read_file(key)
                    except SpillError as error:
                        self._fail(error)
                        raise
            self._cond.wait_for(lambda: key in self._ready or self._error is not None)
            self._raise()
            return self._ready.pop(key)

    def done(self) -> None:
        """The consumer is done with one taken entry: the reader may read one more."""
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the error a thread met, if any."""
        with self._cond:
            self._raise()

    def end_step(self) -> None:
        """The step is over: every entry written was read; drop anything left (a failed step) and reset."""
        self._writes.join()
        with self._cond:
            self._order.clear()
            self._ready.clear()
            self._sizes.clear()
            self._on_disk.clear()
            self._held = 0
            self._reading = None
            self.written = self.read = 0
        for child in os.scandir(self.dir):
            if ENTRY.fullmatch(child.name) and child.is_file(follow_symlinks=False):
                os.unlink(child.path)

    def close(self) -> None:
        """Stop the threads and remove this rank's directory (only the files this module made)."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._error = self._error or SpillError("closed")
            self._cond.notify_all()
        self._writes.put(None)
        for t in self._threads:
            t.join(timeout=60)
        _remove_own_files(self.dir)
        os.close(self._lock)

    # ---- the threads ----

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, error: SpillError) -> None:
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def _path(self, key: Key) -> Path:
        kind, row, mb = key
        return self.dir / f"{kind}-{row}-{mb}"

    def _writer(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                key, tensor, ready = item
                if self._error is None:
                    self._write_file(key, tensor, ready)
                with self._cond:
                    self._pending -= tensor.numel() * tensor.element_size()
            finally:
                self._writes.task_done()

    def _write_file(self, key: Key, tensor: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copy into ``tensor`` is done
        path = self._path(key)
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                while data:
                    data = data[os.write(fd, data):]
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # on disk: the page cache need not keep it
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._fail(SpillError(f"execution.spill_dir: {self.root} ran out of space writing spilled "
                                      f"activations ({self._format(self.step_bytes)} a step); free space there "
                                      f"or set execution.spill_dir to a larger disk"))
            else:
                self._fail(SpillError(f"execution.spill_dir: writing {path} failed ({exc.strerror or exc}); "
                                      f"check the disk under {self.root}"))
            return
        with self._cond:
            self.written += tensor.numel() * tensor.element_size()
            self._on_disk.add(key)
            self._cond.notify_all()

    def _reader(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._error is not None or (
                    self._order and self._held < self.window and self._order[0] in self._on_disk))
                if self._error is not None:
                    return
                key = self._reading = self._order.pop(0)
                self._held += 1
            try:
                tensor = self._read_file(key)
            except SpillError as error:
                self._fail(error)
                return
            with self._cond:
                self._ready[key] = tensor
                self._reading = None
                self._cond.notify_all()

    def _read_file(self, key: Key) -> torch.Tensor:
        """Read ``key``'s file into a fresh tensor, drop it from the page cache and delete it."""
        shape, dtype = self._sizes[key]
        tensor = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_size != len(view):
                    raise OSError(errno.EIO, f"{os.fstat(fd).st_size} bytes, not {len(view)}")
                done = 0
                while done < len(view):
                    n = os.readv(fd, [view[done:]])
                    if n == 0:
                        raise OSError(errno.EIO, "ended early")
                    done += n
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.unlink(path)
        except OSError as exc:
            what = "vanished" if exc.errno == errno.ENOENT else f"could not be read ({exc.strerror or exc})"
            raise SpillError(f"execution.spill_dir: spilled activation file {path} {what} before the backward "
                             f"read it; keep {self.root} for ipuft alone and run again") from None
        with self._cond:
            self.read += len(view)
        return tensor
