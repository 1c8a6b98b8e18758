"""A training run's directory: where it is (``output_dir``, or a fresh ``runs/<timestamp>``), whether a run may
write into it (:func:`check_output_dir`, and :func:`exclusive_run`'s lock for the run's life), whether it and
the checkpoint root can be written and hold a checkpoint (:func:`check_run_paths`, before anything is loaded),
and its ``metrics.jsonl``, repaired when a run resumes (:func:`metrics_file`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO

from omegaconf import DictConfig

from ipuft.engine.model import ModelParts
from ipuft.engine.variables import optimizer_state_specs
from ipuft.errors import ConfigError
from ipuft.io.checkpoint import checkpoint_root, checkpoints, find_checkpoint
from ipuft.optim import Optimizer
from ipuft.precision import Recipe, recipe

LOCK = ".ipuft.lock"  # held by a run for its life (exclusive_run); its presence marks a directory ipuft made
FINISHED = ".ipuft-finished"  # written into the run directory when a run has trained all its steps


def check_output_dir(cfg: DictConfig) -> None:
    """Refuse an ``output_dir`` that already holds a run, unless this run resumes from one of that run's
    own checkpoints (checked on every rank). An ipuft run (it left its lock file) killed before its first
    checkpoint holds nothing to lose: starting it again starts afresh."""
    if cfg.output_dir is None or not (Path(cfg.output_dir) / "metrics.jsonl").exists():
        return
    out = Path(cfg.output_dir)
    root = checkpoint_root(cfg, out)
    if cfg.checkpoint.load is not None:
        if root is not None and find_checkpoint(cfg.checkpoint.load).resolve().parent == root.resolve():
            return
        raise ConfigError(f"output_dir: {out} already holds a run (metrics.jsonl) and checkpoint.load is not one of "
                          f"its checkpoints; choose another output_dir")
    saved = root is not None and root.is_dir() and checkpoints(root)
    if (out / LOCK).exists() and not saved and not (out / FINISHED).exists():
        return
    raise ConfigError(f"output_dir: {out} already holds a run (metrics.jsonl); choose another directory")


def checkpoint_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer) -> int:
    """The bytes of one checkpoint of this model: its full weights and, with ``checkpoint.optim_state``, the
    state of the run's ``optimizer`` (and master copy)."""
    master = recipe(cfg) is Recipe.master
    total = 0
    for unit in parts.program.units():
        variables = parts.variables[unit.role]
        total += sum(v.nbytes for v in variables)
        if cfg.checkpoint.optim_state:
            total += sum(v.nbytes for v in optimizer_state_specs(variables, optimizer, master))
    return total


def check_run_paths(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer) -> None:
    """Before any weight is loaded or any file written: the run directory and the checkpoint root are (or
    can be created as) writable directories, and the checkpoint root's file system has room for a
    checkpoint of this model, so that a run never trains for hours to lose its checkpoint to a path."""
    out = Path(cfg.output_dir) if cfg.output_dir is not None else Path("runs")
    _check_writable_dir(out, "output_dir")
    check_spill_dir(cfg)
    root = checkpoint_root(cfg, out)
    if root is None:
        return
    _check_writable_dir(root, "checkpoint.save")
    needed = checkpoint_bytes(cfg, parts, optimizer)
    free = shutil.disk_usage(_existing_ancestor(root)).free
    if free < needed:
        from ipuft.units import format_bytes

        raise ConfigError(f"checkpoint.save: {root} has {format_bytes(free)} free, but one checkpoint of this model "
                          f"takes {format_bytes(needed)}; free space or save elsewhere")


def check_spill_dir(cfg: DictConfig) -> None:
    """With ``activation_offload=disk`` and ``execution.spill_dir``: a writable directory (or one that can be
    made), whose file system has room for a step's spilled activations (each rank's on this machine)."""
    if cfg.execution.activation_offload != "disk" or cfg.execution.spill_dir is None:
        return
    from ipuft.engine.cuts import step_shape
    from ipuft.units import format_bytes

    path = Path(cfg.execution.spill_dir)
    _check_writable_dir(path, "execution.spill_dir")
    needed = step_shape(cfg).spill_bytes * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = shutil.disk_usage(_existing_ancestor(path)).free
    if free < needed:
        raise ConfigError(f"execution.spill_dir: {path} has {format_bytes(free)} free, but a step spills "
                          f"{format_bytes(needed)} of activations there; free space or spill elsewhere")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable_dir(path: Path, key: str) -> None:
    """``path`` is a directory we can write in, or can be created (probed with a directory made and removed)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {path} exists and is not a directory")
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise ConfigError(f"{key}: {path} cannot be created: {base} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ipuft-probe-", dir=base))
    except OSError as exc:
        raise ConfigError(f"{key}: {path} cannot be written ({exc.strerror or exc} in {base})") from None


def run_directory(cfg: DictConfig) -> Path:
    """``output_dir``, or ``runs/<timestamp>`` (a fresh one); :func:`check_output_dir` has vetted ``output_dir``."""
    if cfg.output_dir is not None:
        path = Path(cfg.output_dir)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = Path("runs") / stamp, 1
        while path.exists():
            path, n = Path("runs") / f"{stamp}-{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def exclusive_run(out: Path, cfg: DictConfig):
    """Hold an exclusive lock (``fcntl.flock`` on ``<run>/.ipuft.lock``) on the run directory for the life
    of the run: a second run into it, or a resume of it while it trains, is refused with one line. The
    output-directory check is repeated under the lock, for a run that got there first and has finished."""
    import fcntl

    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"output_dir: {out} is in use by another ipuft run; wait for it to finish or "
                              f"choose another output_dir") from None
        check_output_dir(cfg)
        yield
    finally:
        os.close(fd)


def metrics_file(out: Path, start: int) -> IO[str]:
    """metrics.jsonl, open for writing, keeping only the records up to ``start`` when resuming. Every line is
    checked before anything is rewritten: a torn line (a run killed while writing it) or garbage is dropped."""
    path = out / "metrics.jsonl"
    kept = []
    if start and path.exists():
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and 0 < step <= start:
                kept.append(line)
    f = open(path, "w")  # noqa: SIM115 (the caller owns the handle for the rest of the run)
    f.writelines(line + "\n" for line in kept)
    return f
