"""The ``ipuft`` console script.

Starting a command imports the plugins' hooks and, for a command that computes, torch, which takes a
second or more; a Ctrl-C then must not end in a traceback (or in an ImportError that a half-imported
extension module turns it into). So while the imports run, SIGINT prints one line and exits with 130 at
once; nothing has been written yet.
"""

from __future__ import annotations

import signal
import sys
import threading

from ipuft.cli.exit import fail
from ipuft.hostmem import huge_pages_for_torch


def _interrupted_while_starting(signum, frame) -> None:
    fail("interrupted", 130, at_once=True)


TORCH_FREE = ("config", "plugins")  # commands that never import torch


def _computes(args: list[str]) -> bool:
    """Whether the command line runs a command that imports torch (any but help, the version and
    ``TORCH_FREE``'s). Torch's import takes a second or more, and a SIGINT inside it leaves an extension
    half-initialised: the next import then fails with an ImportError or a RecursionError, which would be
    reported as that instead of as an interruption."""
    if not args or {"-h", "--help", "--version"} & set(args[: args.index("--")] if "--" in args else args):
        return False
    command = next((a for a in args if not a.startswith("-")), None)
    return command is not None and command not in TORCH_FREE


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ipuft`` console script."""
    if argv is None:  # the process is ours: before torch's first allocation, which reads the setting
        huge_pages_for_torch()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting) if main_thread else None
    try:
        from ipuft.cli.commands import run

        if _computes(sys.argv[1:] if argv is None else argv):
            import torch  # noqa: F401 (imported here, where a Ctrl-C cannot leave it half-imported)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    try:
        run(argv)
    except KeyboardInterrupt:
        fail("interrupted", 130, at_once=argv is None)
    finally:
        if main_thread and argv is None:  # the process is ours
            # The command is over and has printed its outcome. The interpreter's teardown restores SIGINT's
            # default action, so a Ctrl-C there would kill the process by the signal (exit -2, no line);
            # ignored, it leaves the command's own exit code.
            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
