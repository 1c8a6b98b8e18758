"""Errors a user can cause. The CLI prints each as one line and exits with code 2, never a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class IpuftError(Exception):
    """Base class for every error caused by user input: config, data, checkpoints, plugins."""

    exit_code = 2


class ConfigError(IpuftError):
    """A config key, value, override or preset is wrong."""


class PluginError(IpuftError):
    """A plugin failed to load, registered a duplicate, or a requested plugin name is unknown."""


class DataError(IpuftError):
    """A dataset, tokenizer or template is missing or malformed; the message names the file and row."""


class CheckpointError(IpuftError):
    """A checkpoint or Hugging Face directory is missing, unreadable, or of another model's shape."""


class TrainingError(IpuftError):
    """Training cannot go on (for example, too many skipped steps in a row)."""

    exit_code = 1


class SpillError(IpuftError):
    """Activations spilled to disk (``execution.activation_offload=disk``) could not be written or read back:
    the spill directory's disk is full, or a spill file vanished; the message names the directory."""


class DistributedError(IpuftError):
    """A collective failed: a peer rank died or stopped responding."""

    exit_code = 1


class Stopped(IpuftError):
    """A SIGINT or SIGTERM stopped training cleanly; the exit code is 128 + the signal's number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of an exception's message, for a one-line error (``default`` when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else default


def described(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters of it), or ``Type`` alone."""
    message = first_line(exc)[:limit]
    return f"{type(exc).__name__}{': ' + message if message else ''}"


def shown(value: object, limit: int = 40) -> str:
    """A value read from a file (JSON or YAML), as an error message shows what it got: a number as itself, and
    anything else with its type, so that ``"4"`` reads as the string '4', not as the number 4."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return str(value)[:limit]
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value[:limit]!r}"
    kind = {list: "a list", tuple: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")
    return f"{kind} ({str(value)[:limit]})"


def choices(values: Iterable[str]) -> str:
    """Format a list of valid choices for an error message."""
    values = sorted(values)
    return ", ".join(values) if values else "(none installed)"
