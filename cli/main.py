"""The ``ipuft`` console script.

It imports the command line (and with it torch and the plugins) inside its error boundary, so that even a
Ctrl-C while the imports run ends with one line and exit code 130, not a traceback.
"""

from __future__ import annotations

import sys


def fail(message: str, code: int = 2) -> None:
    """Print one line naming what is wrong, and exit."""
    sys.stderr.write(f"ipuft: error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ipuft`` console script."""
    try:
        from ipuft.cli.commands import run

        run(argv)
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":
    main()
