"""The ``ipuft`` console script.

Importing the command line imports torch and the plugins, which takes seconds; a Ctrl-C then must not
end in a traceback (or in an ImportError that a half-imported extension module turns it into). So while
the imports run, SIGINT prints one line and exits with 130 at once; nothing has been written yet.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def fail(message: str, code: int = 2, at_once: bool = False) -> None:
    """Print one line naming what is wrong, and exit; ``at_once`` ends the process without the interpreter's
    teardown (every ``finally`` on the way here has run; buffered output is flushed)."""
    sys.stderr.write(f"ipuft: error: {message}\n")
    sys.stderr.flush()
    if at_once:
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def _interrupted_while_starting(signum, frame) -> None:
    sys.stderr.write("ipuft: error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ipuft`` console script."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting) if main_thread else None
    try:
        from ipuft.cli.commands import run
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    try:
        run(argv)
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":
    main()
