"""The training loop behind ``ipuft train`` and ``ipuft bench``.

It builds the model and the run's one optimizer from the plugins, owns the learning-rate schedule and the data
position, runs the phased engine one optimizer step at a time, and writes the resolved ``config.yaml`` and
``metrics.jsonl`` (one JSON object per step) into the run directory, which :mod:`ipuft.run.rundir` vets,
locks and repairs; :mod:`ipuft.run.resume` saves its checkpoints and resumes it from one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tqdm import tqdm

from ipuft.config import to_yaml, with_values
from ipuft.data.synthetic import SampleData
from ipuft.data.tokens import TokenDataset, data_source, validation_source
from ipuft.engine.inference import dataset_loss
from ipuft.engine.model import build_model
from ipuft.engine.phased import StepResult
from ipuft.engine.spill import spill_root
from ipuft.errors import Stopped, TrainingError
from ipuft.io.checkpoint import checkpoint_root
from ipuft.loggers import Backends
from ipuft.parallel import Layout, collective_errors
from ipuft.plan.flops import StepFlops, step_flops, utilisation
from ipuft.plugins import PluginHooks
from ipuft.preference import PreferenceLoss
from ipuft.run.layout import choose_layout
from ipuft.run.reference import preference_scores, prepare_reference
from ipuft.run.resume import checkpoint_to_resume, restore, run_files, save
from ipuft.run.rundir import (
    FINISHED,
    check_output_dir,
    check_run_paths,
    exclusive_run,
    metrics_file,
    run_directory,
)
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate


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


def metrics_record(step: int, result: StepResult, lr: float, tokens: int, seconds: float, flops: StepFlops) -> dict:
    """One step's line of metrics.jsonl: the step's results, its speed, and this rank's FLOP/s (model and
    recompute apart, :mod:`ipuft.plan.flops`)."""
    record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
              "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "step_time_s": seconds,
              **utilisation(flops, seconds if seconds > 0 else math.inf)}
    record.update({k: v for k, v in asdict(result).items() if k not in ("loss", "grad_norm", "metrics")})
    record.update(result.metrics)  # preference data: TRL's rewards/* and logps/*
    return record


def with_epochs(cfg: DictConfig, data: SampleData | TokenDataset) -> DictConfig:
    """``cfg`` with ``training.steps`` the steps ``training.epochs`` passes over ``data``'s rows take,
    ``ceil(epochs × rows / global_batch_size)`` (the epochs read as the decimal written, so that 0.1 of 320 rows
    in batches of 32 is one step); ``cfg`` itself without epochs."""
    if cfg.training.epochs is None:
        return cfg
    share = Fraction(str(cfg.training.epochs)) * len(data) / cfg.training.global_batch_size
    return with_values(cfg, {"training.steps": max(1, math.ceil(share))})


def epoch(cfg: DictConfig, data: SampleData | TokenDataset, step: int) -> float | None:
    """The passes over ``data``'s rows the first ``step`` steps have made (None for the endless sample data)."""
    if isinstance(data, SampleData):
        return None
    return step * cfg.training.global_batch_size / len(data)


def train(cfg: DictConfig, hooks: PluginHooks, progress: bool = True) -> list[dict]:
    """Train until ``training.steps``; return the metrics of the steps run.

    With ``checkpoint.load`` the run resumes where the checkpoint stopped: weights, optimizer state,
    update count, loss scale, data position and RNG, so the result is that of an uninterrupted run.
    Under torchrun every rank trains its share; rank 0 alone prints progress and writes the run directory.
    A non-finite loss or gradient norm skips the update; ``training.max_consecutive_skips`` in a row stop
    the run. SIGINT or SIGTERM saves a checkpoint (when saving is on) and stops with exit code 130 or 143.
    """
    cfg = choose_layout(cfg, hooks)[0]  # execution.recompute/offload=auto (the CLI has chosen them already)
    data = data_source(cfg)
    cfg = with_epochs(cfg, data)  # training.epochs: the steps those passes take
    resumed = checkpoint_to_resume(cfg, hooks.registrations.config_sections)
    files = run_files(cfg)  # the model's tokenizer and source config, checked now, carried in every checkpoint
    validation = validation_source(cfg, data) if cfg.training.eval_steps else None
    check_output_dir(cfg)
    # One optimizer for the run: the model rules check its state's layout, the run-path check sizes a
    # checkpoint of its state, and the engine steps it.
    optimizer = hooks.registrations.build_optimizer(cfg)
    parts = build_model(cfg, hooks, optimizer)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone writes the run directory
        check_run_paths(cfg, parts, optimizer)
    engine = build_engine(cfg, hooks, parts, optimizer)
    flops = step_flops(cfg, parts, device=engine.device)
    start = restore(engine, cfg, resumed, data) if resumed is not None else 0
    preference = PreferenceLoss.of(cfg)  # data.format=preference: the reference pass, or the resumed run's
    prepare_reference(cfg, engine.model, data, validation, resumed, files)
    main = engine.layout.is_main
    out = run_directory(cfg) if main else None
    lock = exclusive_run(out, cfg) if main else nullcontext()
    if engine.buffers.spill is not None:  # activation_offload=disk: into the run directory unless spill_dir says
        engine.buffers.spill.root = spill_root(cfg.execution.spill_dir, out or cfg.output_dir)
    root = checkpoint_root(cfg, out) if main else (None if cfg.checkpoint.save is None else Path("."))
    steps = cfg.training.steps
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    records, skips, saved = [], 0, None
    with lock, closing(engine), (metrics_file(out, start) if main else nullcontext()) as metrics, \
            collective_errors(engine.layout), _Signals() as signals, _backends(cfg, out, hooks, main) as backends:
        if main:
            (out / "config.yaml").write_text(to_yaml(cfg))
        if progress and main and cfg.training.epochs is not None:
            tqdm.write(f"training.epochs={cfg.training.epochs:g}: {steps} steps of {cfg.training.global_batch_size} "
                       f"rows over {len(data)} rows")
        bar = tqdm(range(start, steps), desc="train", unit="step", disable=not (progress and main),
                   dynamic_ncols=True, initial=start, total=steps)
        for step in bar:
            lr = learning_rate(step, steps, cfg.training.optimizer.learning_rate)
            batch = replica_batch(cfg, data, step, engine.layout)
            began = time.perf_counter()
            result = engine.step(batch, lr)
            record = metrics_record(step + 1, result, lr, tokens, time.perf_counter() - began, flops)
            passes = epoch(cfg, data, step + 1)
            if passes is not None:
                record["epoch"] = passes
            if validation is not None and ((step + 1) % cfg.training.eval_steps == 0 or step + 1 == steps):
                scored = dataset_loss(engine.model, validation, cfg.execution.micro_batch_size) \
                    if preference is None else preference_scores(engine.model, validation,
                                                                 cfg.execution.micro_batch_size, preference)
                record.update({f"validation_{k}": v for k, v in scored.items()})
            records.append(record)
            if main:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                backends.log(step + 1, record)
            pairs = {"margin": f"{result.metrics['rewards/margins']:.3f}",
                     "acc": f"{result.metrics['rewards/accuracies']:.2f}"} if result.metrics else {}
            bar.set_postfix(loss=f"{result.loss:.3f}", **pairs, gnorm=f"{result.grad_norm:.2f}", lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"epoch": f"{passes:.2f}"} if passes is not None else {}))
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
                saved = save(engine, cfg, root, step + 1, data, files)
                where = f"; checkpoint {saved}" if saved else ""
                raise Stopped(f"stopped by {signal.Signals(received).name} after step {step + 1}{where}", received)
            every = cfg.checkpoint.steps
            if every and (step + 1) % every == 0 and step + 1 < steps:
                save(engine, cfg, root, step + 1, data, files)
        saved = save(engine, cfg, root, steps, data, files)
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
