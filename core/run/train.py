"""The training loop behind ``ipuft train`` and ``ipuft bench``.

It builds the model from the plugins, owns the learning-rate schedule and the data position, runs the
phased engine one optimizer step at a time, and writes the run directory: the resolved ``config.yaml``
and ``metrics.jsonl`` (one JSON object per step).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tqdm import tqdm

from ipuft.config import to_yaml
from ipuft.data.synthetic import SampleData
from ipuft.data.tokenizer import tokenizer_path, tokenizer_source
from ipuft.data.tokens import TokenDataset, data_source, validation_source
from ipuft.engine.flops import StepFlops, step_flops, utilisation
from ipuft.engine.inference import dataset_loss
from ipuft.engine.model import ModelParts, build_model
from ipuft.engine.phased import PhasedEngine, StepResult
from ipuft.engine.precision import Recipe, recipe
from ipuft.engine.variables import optimizer_state_specs
from ipuft.errors import ConfigError, Stopped, TrainingError
from ipuft.io.checkpoint import (
    OPTIM,
    WEIGHTS,
    Contents,
    checkpoint_initializer,
    checkpoint_root,
    checkpoints,
    find_checkpoint,
    read_meta,
    restore_rng,
    resume_differences,
    save_checkpoint,
)
from ipuft.loggers import Backends
from ipuft.parallel import Layout, collective_errors
from ipuft.plugins import PluginHooks
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate


def tokenizer_file(cfg: DictConfig) -> Path | None:
    """The tokenizer.json the run's data was tokenized with, if any, else the Hugging Face checkpoint's own
    (copied into checkpoints, so that an export or ``generate`` has the model's tokenizer)."""
    if cfg.data.path is None:  # synthetic tokens: no tokenizer made them
        own = Path(cfg.model.hf_checkpoint) / "tokenizer.json" if cfg.model.hf_checkpoint else None
        return own if own is not None and own.is_file() else None
    source = tokenizer_source(cfg)
    return None if source is None else tokenizer_path(source[0])


def save(engine: PhasedEngine, cfg: DictConfig, root: Path | None, step: int, data=None) -> Path | None:
    """Every rank takes part in gathering the full weights (and optimizer state), one tensor at a time; rank 0
    writes each into the checkpoint as it arrives (see :mod:`ipuft.io.checkpoint`)."""
    if root is None:
        return None
    groups = ("fwd", "optim") if cfg.checkpoint.optim_state else ("fwd",)
    tensors = engine.model.full_tensors(groups)
    if not engine.layout.is_main:
        for _ in tensors:  # this rank's part of each gather; rank 0 writes
            pass
        return None
    files = {"fwd": WEIGHTS, "optim": OPTIM}
    units = engine.program.units()
    contents = Contents(
        units=units,
        files={files[g]: [replace(s, name=f"{u}.{s.name}") for u in units for s in engine.model.full_specs(u, g)]
               for g in groups},
        tensors=((files[group], f"{unit}.{spec.name}", t) for unit, group, spec, t in tensors))
    state = {"updates": engine.updates, "loss_scale": engine.scale.state_dict(),
             "data": data.state_dict() if hasattr(data, "state_dict") else {"step": step}}
    return save_checkpoint(contents, cfg, root, step, tokenizer_file(cfg), keep=cfg.checkpoint.to_keep, state=state)


def restore(engine: PhasedEngine, cfg: DictConfig, checkpoint: Path, data) -> int:
    """Resume a run's state from ``checkpoint`` (weights are already loaded); return its step."""
    meta = read_meta(checkpoint)
    if cfg.checkpoint.optim_state and meta.get("optim_state"):
        units = engine.program.units()
        state_of = checkpoint_initializer(checkpoint, OPTIM, units=units)  # verified as it is read
        for unit in units:
            specs = engine.model.full_specs(unit, "optim")
            engine.model.load_full("optim", {unit: state_of(unit, specs, engine.model.full_homes(unit, "optim"))})
    engine.updates = int(meta.get("updates", meta["step"]))
    if "loss_scale" in meta:
        engine.scale.load_state_dict(meta["loss_scale"])
    if hasattr(data, "load_state_dict") and "rows" in meta.get("data", {}):
        data.load_state_dict(meta["data"])
    restore_rng(checkpoint)
    return int(meta["step"])


class _Signals:
    """SIGINT and SIGTERM during training ask for a clean stop after the current step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def agreed(self, layout: Layout, device: torch.device) -> int | None:
        """The signal, if any rank received one (every rank must stop at the same step); the flag is reduced
        on ``device``, where the process group's backend works."""
        if not layout.distributed:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None


def replica_batch(cfg: DictConfig, data: SampleData | TokenDataset, step: int, layout: Layout):
    """This rank's micro-batches of global batch ``step`` (TP ranks of one DP replica share them)."""
    return data.batch(step, cfg.training.global_batch_size, cfg.execution.micro_batch_size,
                      layout.dp_rank, layout.data_parallel)


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


def checkpoint_bytes(cfg: DictConfig, parts: ModelParts, hooks: PluginHooks) -> int:
    """The bytes of one checkpoint of this model: its full weights and, with ``checkpoint.optim_state``, the
    optimizer state (and master copy)."""
    optimizer = hooks.registrations.build_optimizer(cfg)
    master = recipe(cfg) is Recipe.master
    total = 0
    for unit in parts.program.units():
        variables = parts.variables[unit.role]
        total += sum(v.nbytes for v in variables)
        if cfg.checkpoint.optim_state:
            total += sum(v.nbytes for v in optimizer_state_specs(variables, optimizer, master))
    return total


def check_run_paths(cfg: DictConfig, parts: ModelParts, hooks: PluginHooks) -> None:
    """Before any weight is loaded or any file written: the run directory and the checkpoint root are (or
    can be created as) writable directories, and the checkpoint root's file system has room for a
    checkpoint of this model, so that a run never trains for hours to lose its checkpoint to a path."""
    out = Path(cfg.output_dir) if cfg.output_dir is not None else Path("runs")
    _check_writable_dir(out, "output_dir")
    root = checkpoint_root(cfg, out)
    if root is None:
        return
    _check_writable_dir(root, "checkpoint.save")
    needed = checkpoint_bytes(cfg, parts, hooks)
    free = shutil.disk_usage(_existing_ancestor(root)).free
    if free < needed:
        from ipuft.engine.fit import format_bytes

        raise ConfigError(f"checkpoint.save: {root} has {format_bytes(free)} free, but one checkpoint of this model "
                          f"takes {format_bytes(needed)}; free space or save elsewhere")


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


def metrics_record(step: int, result: StepResult, lr: float, tokens: int, seconds: float, flops: StepFlops) -> dict:
    """One step's line of metrics.jsonl: the step's results, its speed, and this rank's FLOP/s (model and
    recompute apart, :mod:`ipuft.engine.flops`)."""
    record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
              "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "step_time_s": seconds,
              **utilisation(flops, seconds if seconds > 0 else math.inf)}
    record.update({k: v for k, v in asdict(result).items() if k not in ("loss", "grad_norm")})
    return record


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


def _metrics_file(out: Path, start: int):
    """metrics.jsonl, keeping only the records up to ``start`` when resuming. Every line is checked before
    anything is rewritten: a torn line (a run killed while writing it) or garbage is dropped."""
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


def train(cfg: DictConfig, hooks: PluginHooks, progress: bool = True) -> list[dict]:
    """Train until ``training.steps``; return the metrics of the steps run.

    With ``checkpoint.load`` the run resumes where the checkpoint stopped: weights, optimizer state,
    update count, loss scale, data position and RNG, so the result is that of an uninterrupted run.
    Under torchrun every rank trains its share; rank 0 alone prints progress and writes the run directory.
    A non-finite loss or gradient norm skips the update; ``training.max_consecutive_skips`` in a row stop
    the run. SIGINT or SIGTERM saves a checkpoint (when saving is on) and stops with exit code 130 or 143.
    """
    resumed = find_checkpoint(cfg.checkpoint.load) if cfg.checkpoint.load is not None else None
    if resumed is not None:
        meta = read_meta(resumed)
        if meta["step"] >= cfg.training.steps:
            raise ConfigError(f"training.steps: {resumed} is at step {meta['step']} and training.steps="
                              f"{cfg.training.steps}, so there is nothing to train; raise training.steps")
        if differences := resume_differences(cfg, resumed, meta):
            raise ConfigError(f"checkpoint.load: resuming {resumed} would change {'; '.join(differences)}; keep "
                              f"them, or list the keys in checkpoint.allow_changes to accept the change")
    data = data_source(cfg)
    validation = validation_source(cfg, data) if cfg.training.eval_steps else None
    check_output_dir(cfg)
    parts = build_model(cfg, hooks, hooks.registrations.build_optimizer(cfg))
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone writes the run directory
        check_run_paths(cfg, parts, hooks)
    engine = build_engine(cfg, hooks, parts)
    flops = step_flops(cfg, parts, device=engine.device)
    start = restore(engine, cfg, resumed, data) if resumed is not None else 0
    main = engine.layout.is_main
    out = run_directory(cfg) if main else None
    lock = exclusive_run(out, cfg) if main else nullcontext()
    root = checkpoint_root(cfg, out) if main else (None if cfg.checkpoint.save is None else Path("."))
    steps = cfg.training.steps
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    records, skips, saved = [], 0, None
    with lock, (_metrics_file(out, start) if main else nullcontext()) as metrics, \
            collective_errors(engine.layout), _Signals() as signals, _backends(cfg, out, hooks, main) as backends:
        if main:
            (out / "config.yaml").write_text(to_yaml(cfg))
        bar = tqdm(range(start, steps), desc="train", unit="step", disable=not (progress and main),
                   dynamic_ncols=True, initial=start, total=steps)
        for step in bar:
            lr = learning_rate(step, steps, cfg.training.optimizer.learning_rate)
            batch = replica_batch(cfg, data, step, engine.layout)
            began = time.perf_counter()
            result = engine.step(batch, lr)
            record = metrics_record(step + 1, result, lr, tokens, time.perf_counter() - began, flops)
            if validation is not None and ((step + 1) % cfg.training.eval_steps == 0 or step + 1 == steps):
                scored = dataset_loss(engine.model, validation, cfg.execution.micro_batch_size)
                record.update({f"validation_{k}": v for k, v in scored.items()})
            records.append(record)
            if main:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                backends.log(step + 1, record)
            bar.set_postfix(loss=f"{result.loss:.3f}", gnorm=f"{result.grad_norm:.2f}", lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            skips = skips + 1 if result.skipped else 0
            if result.skipped and main:
                tqdm.write(f"step {step + 1}: non-finite loss or gradient norm; update skipped (loss scale "
                           f"{result.loss_scale:g} -> {engine.scale.scale:g})")
            if skips >= cfg.training.max_consecutive_skips:
                raise TrainingError(f"{skips} optimizer steps in a row were skipped for a non-finite loss or gradient "
                                    f"norm (last at step {step + 1}); lower the learning rate or set "
                                    f"execution.loss_scaling=dynamic")
            received = signals.agreed(engine.layout, engine.device)
            if received is not None:
                saved = save(engine, cfg, root, step + 1, data)
                where = f"; checkpoint {saved}" if saved else ""
                raise Stopped(f"stopped by {signal.Signals(received).name} after step {step + 1}{where}", received)
            every = cfg.checkpoint.steps
            if every and (step + 1) % every == 0 and step + 1 < steps:
                save(engine, cfg, root, step + 1, data)
        saved = save(engine, cfg, root, steps, data)
        if main:
            (out / FINISHED).touch()
    if progress and main and records:
        tqdm.write(f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} over steps {start + 1}-{steps}; "
                   f"run directory {out}" + (f"; checkpoint {saved}" if saved else ""))
    return records


@contextmanager
def _backends(cfg: DictConfig, out: Path | None, hooks: PluginHooks, main: bool):
    """The run's logging backends (rank 0), told at the end whether the run finished, stopped or failed."""
    if not main:
        yield None
        return
    backends = Backends(cfg, out, hooks.registrations.loggers)
    status = "failed"
    try:
        yield backends
        status = "finished"
    except Stopped:
        status = "stopped"
        raise
    finally:
        backends.finish(status)
