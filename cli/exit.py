"""How the console script ends on an error: one line on stderr naming what is wrong, and an exit code. Both
:mod:`ipuft.cli.main` (a Ctrl-C while starting) and :mod:`ipuft.cli.commands` (the error boundary) end so."""

from __future__ import annotations

import os
import sys


def fail(message: str, code: int = 2, at_once: bool = False) -> None:
    """Print one line naming what is wrong, and exit; ``at_once`` ends the process without the interpreter's
    teardown (every ``finally`` on the way here has run; buffered output is flushed). A Ctrl-C ends so: a
    KeyboardInterrupt that landed in code Python ran for an extension (as torch's import does) makes the
    interpreter kill itself by SIGINT at exit, whatever code it was given (exit -2)."""
    sys.stderr.write(f"ipuft: error: {message}\n")
    sys.stderr.flush()
    if at_once:
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)
