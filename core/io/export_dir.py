"""Where an export may write: one check for every ``ipuft export`` target (``--hf``, ``--adapter``, ``--gguf``),
and the staged directory each export writes into and renames into place (a directory, or the file in it).

An export is a new directory of its own. It never writes inside an ipuft checkpoint or run directory (one typo,
``--adapter runs/a/checkpoints/step-6``, would otherwise leave a checkpoint that no longer loads), never over or
around a source it reads, and never leaves a temporary behind: not on success, not on a failure, not when
interrupted. A target that is a symbolic link is followed: the export is written where the link points, and the
link stays as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ipuft.errors import CheckpointError, first_line
from ipuft.io.checkpoint import MANIFEST, WEIGHTS

# What marks a directory ipuft made for a run: its metrics, its lock (ipuft.run.rundir.LOCK), its finished mark.
RUN_MARKS = ("metrics.jsonl", ".ipuft.lock", ".ipuft-finished")


def _kind(directory: Path) -> str | None:
    """``"checkpoint"`` or ``"run directory"`` where ``directory`` is one of ipuft's, else None."""
    if (directory / MANIFEST).is_file() or ((directory / WEIGHTS).is_file() and (directory / "meta.json").is_file()):
        return "checkpoint"
    if any((directory / mark).exists() for mark in RUN_MARKS):
        return "run directory"
    return None


def check_export_target(out: str | Path, option: str, sources: Sequence[Path],
                        replaceable: Callable[[Path], bool] | None = None, file: bool = False) -> Path:
    """The directory (``file``: the file) an export named ``out`` writes (``out`` with its links resolved), after
    refusing, in one :class:`CheckpointError` line naming ``option`` (``--hf``) and the path: a place inside (or
    at) an ipuft checkpoint or run directory, one at, inside or around a source the export reads (``sources``:
    the checkpoint), and one that exists and is not an empty directory (``file``: is a directory, or a file) or
    one ``replaceable`` accepts (an earlier export of the same kind, replaced whole)."""
    target = Path(out).resolve()
    for place in (target, *target.parents):
        if (kind := _kind(place)) is not None:
            where = "is" if place == target else f"is inside {place},"
            raise CheckpointError(f"{option} {out} {where} an ipuft {kind}; an export never writes into one "
                                  f"(it would no longer load): choose a directory outside it")
    for source in (Path(s).resolve() for s in sources):
        if target == source or source.is_relative_to(target) or target.is_relative_to(source):
            raise CheckpointError(f"{option} {out} would write over {source}, which the export reads; choose a "
                                  f"directory apart from it")
    if file and target.is_dir():
        raise CheckpointError(f"{option} {out} is a directory; name the file to write")
    if file and target.exists() and not (replaceable and replaceable(target)):
        raise CheckpointError(f"{option} {out} exists and is not an earlier export of its kind; choose a new file")
    if not file and target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (
            replaceable and replaceable(target)))):
        earlier = "" if replaceable is None else " or an earlier export of its kind"
        raise CheckpointError(f"{option} {out} exists and is not an empty directory{earlier}; choose a new "
                              f"directory")
    return target


def _scratch(target: Path, out: Path, option: str) -> Path:
    """A new temporary directory beside ``target``."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise CheckpointError(f"{option} {out} cannot be written ({exc.strerror or exc})") from None


def _ours(exc: BaseException) -> bool:
    """Whether what stopped an export goes on as it is: our own line, or an interrupt."""
    return isinstance(exc, CheckpointError) or not isinstance(exc, Exception)


def _failed(exc: BaseException, out: Path, option: str) -> CheckpointError:
    """Anything else that stopped an export, as one line."""
    why = getattr(exc, "strerror", None) or first_line(exc, type(exc).__name__)
    return CheckpointError(f"{option} {out} cannot be written ({why}); nothing was left behind")


@contextlib.contextmanager
def staged_directory(out: Path, option: str, sources: Sequence[Path],
                     replaceable: Callable[[Path], bool] | None = None):
    """A temporary directory beside the target of ``out`` (:func:`check_export_target`, checked again now) to
    write an export into, renamed into place when the block ends (as checkpoints are): a full disk, a read-only
    place, an interrupt or a kill leaves no partial export under the final name, and nothing else behind but
    what a kill interrupts. An earlier export it replaces is put back if the new one cannot take its place."""
    target = check_export_target(out, option, sources, replaceable)
    tmp = _scratch(target, out, option)
    old = None
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for the scratch directory, not the export
        if target.exists():
            old = target.parent / f".{target.name}.old-{tmp.name}"
            os.replace(target, old)  # empty or replaceable, checked above
        os.replace(tmp, target)
    except BaseException as exc:
        if old is not None and not target.exists():
            os.replace(old, target)  # the previous export back in place
            old = None
        if _ours(exc):
            raise
        raise _failed(exc, out, option) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_file(out: Path, option: str, sources: Sequence[Path], replaceable: Callable[[Path], bool] | None = None):
    """A temporary directory beside the target file of ``out`` (:func:`check_export_target`, checked again now)
    for an export to write into: the file the block leaves there under the target's name is renamed into place
    when the block ends (replacing an earlier export at once), and the directory goes, whatever happens, as
    :func:`staged_directory`'s does."""
    target = check_export_target(out, option, sources, replaceable, file=True)
    tmp = _scratch(target, out, option)
    try:
        yield tmp
        os.replace(tmp / target.name, target)
    except BaseException as exc:
        if _ours(exc):
            raise
        raise _failed(exc, out, option) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
