"""How far rendering one data row through a template may go: the characters it may yield and the seconds it may
take (``data.template_max_chars``, ``data.template_seconds``), and the deadline that stops it.

A template is data the user downloaded: an instruction template's ``{instruction:999999999}`` asks
``str.format`` for a gigabyte, a chat template's nested loops that print nothing, or ``lipsum(n=10**9)``, run
inside one Python call that no check between output chunks ever sees. The size bound is checked before each
piece is made (a format width, a string repeated); the time bound is a :func:`deadline`, which interrupts the
rendering thread wherever it is, between two bytecodes of the template or of any Python function it calls.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

DEFAULT_MAX_CHARS = 1 << 24  # a data row's own bound (ipuft.data.files.MAX_ROW_CHARS); a real row is kB
DEFAULT_SECONDS = 10.0  # a real chat template renders a conversation in about a millisecond


@dataclass(frozen=True)
class RenderBounds:
    """The characters one rendering may yield, and the wall-clock seconds one chat template rendering may take."""

    max_chars: int = DEFAULT_MAX_CHARS
    seconds: float = DEFAULT_SECONDS

    @classmethod
    def of(cls, data) -> RenderBounds:
        """The bounds a config's ``data`` section sets."""
        return cls(int(data.template_max_chars), float(data.template_seconds))


class Overrun(BaseException):
    """Raised in a rendering thread whose :func:`deadline` passed. A BaseException, so that no ``except
    Exception`` of the template engine (or of a function the template calls) takes it for its own."""


class _Watchdog:
    """One daemon thread that raises :class:`Overrun` in every thread whose deadline has passed: a rendering is
    armed and disarmed under a lock, with no thread started per rendering (a dataset renders thousands)."""

    POLL = 0.02  # seconds between checks: a deadline is met to within this

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, float] = {}  # thread id -> monotonic deadline
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> None:
        with self._lock:
            self._armed[threading.get_ident()] = time.monotonic() + seconds
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="ipuft-render-deadline", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        """Stop watching this thread, and drop an :class:`Overrun` raised in it that has not yet arrived: once
        this returns, none can."""
        ident = threading.get_ident()
        with self._lock:
            fired = self._armed.pop(ident, None) == -1.0
        if fired:
            _raise_in(ident, None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL)
            now = time.monotonic()
            with self._lock:
                for ident, when in self._armed.items():
                    if 0 <= when < now:
                        self._armed[ident] = -1.0  # fired: disarm clears what may still be pending
                        _raise_in(ident, Overrun)


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """Have thread ``ident`` raise ``exc`` at its next bytecode (None: cancel one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc))


_WATCHDOG = _Watchdog()


@contextmanager
def deadline(seconds: float):
    """Run the block for at most ``seconds``: past them, :class:`Overrun` is raised inside it, wherever it is
    (a C call that never returns to Python, one huge allocation, is not interrupted: the size bounds are for
    those). Catch :class:`Overrun` around the ``with``: it may also arrive as the block ends."""
    _WATCHDOG.arm(seconds)
    try:
        yield
    finally:
        _WATCHDOG.disarm()


DEFAULT_BOUNDS = RenderBounds()  # the keys' defaults, for callers without a config
