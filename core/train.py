"""The training loop behind ``ipuft train`` and ``ipuft bench``.

It builds the model from the plugins, owns the learning-rate schedule and the data position, runs the
phased engine one optimizer step at a time, and writes the run directory: the resolved ``config.yaml``
and ``metrics.jsonl`` (one JSON object per step).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from ipuft.config import to_yaml
from ipuft.data import SampleData
from ipuft.engine import PhasedEngine, StepResult
from ipuft.errors import ConfigError
from ipuft.model import build_model
from ipuft.plugins import PluginHooks
from ipuft.schedule import learning_rate


def select_device(cfg: DictConfig) -> torch.device:
    """``execution.device``: ``auto`` takes CUDA when available."""
    choice = cfg.execution.device.value
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("execution.device: cuda was asked for but no CUDA device is available; use auto or cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def build_engine(cfg: DictConfig, hooks: PluginHooks) -> PhasedEngine:
    """The model's components, the configured optimizer and the engine that owns their variables."""
    parts = build_model(cfg, hooks)
    optimizer = hooks.registrations.optimizers.get(cfg.training.optimizer.name).build(cfg)
    torch.manual_seed(cfg.model.seed)
    return PhasedEngine(cfg, parts, optimizer, select_device(cfg))


def sample_data(cfg: DictConfig) -> SampleData:
    if cfg.data.path is not None:
        raise ConfigError("data.path: reading datasets is not implemented yet; leave it null for the sample data")
    return SampleData(cfg.model.embedding.vocab_size, cfg.model.sequence_length, cfg.data.seed)


def run_directory(cfg: DictConfig) -> Path:
    """``output_dir``, or ``runs/<timestamp>``; never one that already holds a run."""
    if cfg.output_dir is not None:
        path = Path(cfg.output_dir)
        if (path / "metrics.jsonl").exists():
            raise ConfigError(f"output_dir: {path} already holds a run (metrics.jsonl); choose another directory")
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = Path("runs") / stamp, 1
        while path.exists():
            path, n = Path("runs") / f"{stamp}-{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def metrics_record(step: int, result: StepResult, lr: float, tokens: int, seconds: float) -> dict:
    record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
              "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "step_time_s": seconds}
    record.update({k: v for k, v in asdict(result).items() if k not in ("loss", "grad_norm")})
    return record


def train(cfg: DictConfig, hooks: PluginHooks, progress: bool = True) -> list[dict]:
    """Train for ``training.steps`` optimizer steps; return the metrics of every step."""
    engine = build_engine(cfg, hooks)
    data = sample_data(cfg)
    out = run_directory(cfg)
    (out / "config.yaml").write_text(to_yaml(cfg))
    steps = cfg.training.steps
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    records = []
    bar = tqdm(range(steps), desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    with open(out / "metrics.jsonl", "w") as metrics:
        for step in bar:
            lr = learning_rate(step, steps, cfg.training.optimizer.learning_rate)
            batch = data.batch(step, cfg.training.global_batch_size, cfg.execution.micro_batch_size)
            start = time.perf_counter()
            result = engine.step(batch, lr)
            record = metrics_record(step + 1, result, lr, tokens, time.perf_counter() - start)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            records.append(record)
            bar.set_postfix(loss=f"{result.loss:.3f}", gnorm=f"{result.grad_norm:.2f}", lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
    if progress and records:
        tqdm.write(f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} over {steps} steps; "
                   f"run directory {out}")
    return records


def benchmark(cfg: DictConfig, hooks: PluginHooks, timed_steps: int = 5) -> dict:
    """The reference's ``main()``: one untimed step, then ``timed_steps`` timed steps."""
    engine = build_engine(cfg, hooks)
    data = sample_data(cfg)
    batch = data.batch(0, cfg.training.global_batch_size, cfg.execution.micro_batch_size)
    lr = cfg.training.optimizer.learning_rate.maximum
    engine.step(batch, lr)
    durations = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        result = engine.step(batch, lr)
        durations.append(time.perf_counter() - start)
    duration = sum(durations) / len(durations)
    samples = cfg.training.global_batch_size
    return {"duration_s": duration, "samples_per_s": samples / duration,
            "tokens_per_s": samples * cfg.model.sequence_length / duration, "loss": result.loss,
            "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
            "device_peak_bytes": result.device_peak_bytes, "device": str(engine.device)}
