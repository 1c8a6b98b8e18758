"""The training loop behind ``ipuft train`` and ``ipuft bench``.

It builds the model from the plugins, owns the learning-rate schedule and the data position, runs the
phased engine one optimizer step at a time, and writes the run directory: the resolved ``config.yaml``
and ``metrics.jsonl`` (one JSON object per step).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tqdm import tqdm

from ipuft.config import to_yaml
from ipuft.data import SampleData
from ipuft.datasets import TokenDataset, data_source
from ipuft.engine import PhasedEngine, StepResult
from ipuft.errors import ConfigError
from ipuft.checkpoint import checkpoint_initializer, checkpoint_root, find_checkpoint, save_checkpoint
from ipuft.engine import Initializer
from ipuft.hf_checkpoint import hf_initializer
from ipuft.model import ModelParts, build_model
from ipuft.parallel import DistributedError, Layout, init_layout
from ipuft.plugins import PluginHooks
from ipuft.schedule import learning_rate


def select_device(cfg: DictConfig) -> torch.device:
    """``execution.device``: ``auto`` takes CUDA when available; under torchrun, the local rank's GPU."""
    choice = cfg.execution.device.value
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("execution.device: cuda was asked for but no CUDA device is available; use auto or cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(choice)


def initializer(cfg: DictConfig, parts: ModelParts) -> Initializer | None:
    """Initial weights from ``checkpoint.load`` or ``model.hf_checkpoint``; ``None``: random (seeded)."""
    if cfg.checkpoint.load is not None:
        return checkpoint_initializer(find_checkpoint(cfg.checkpoint.load))
    if cfg.model.hf_checkpoint is not None:
        return hf_initializer(cfg.model.hf_checkpoint, parts.modules, cfg.model.layers)
    return None


def build_engine(cfg: DictConfig, hooks: PluginHooks) -> PhasedEngine:
    """Join the process layout, then build the components, the optimizer and the engine."""
    device = select_device(cfg)
    layout = init_layout(cfg, device)
    parts = build_model(cfg, hooks)
    optimizer = hooks.registrations.optimizers.get(cfg.training.optimizer.name).build(cfg)
    torch.manual_seed(cfg.model.seed)
    return PhasedEngine(cfg, parts, optimizer, device, layout, initializer(cfg, parts))


def tokenizer_file(cfg: DictConfig) -> Path | None:
    """The tokenizer.json the run's data was tokenized with, if any (copied into checkpoints)."""
    spec = cfg.data.tokenizer or cfg.model.hf_checkpoint
    if spec is None or cfg.data.path is None:
        return None
    if spec == "sample":
        from importlib import resources

        return Path(str(resources.files("ipuft.sample_data") / "tokenizer.json"))
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def save(engine: PhasedEngine, cfg: DictConfig, root: Path | None, step: int) -> Path | None:
    """Every rank gathers; rank 0 writes the checkpoint."""
    if root is None:
        return None
    weights = engine.full_weights()
    if not engine.layout.is_main:
        return None
    return save_checkpoint(weights, cfg, root, step, tokenizer_file(cfg), keep=cfg.checkpoint.to_keep)


def replica_batch(cfg: DictConfig, data: SampleData | TokenDataset, step: int, layout: Layout):
    """This rank's micro-batches of global batch ``step`` (TP ranks of one DP replica share them)."""
    return data.batch(step, cfg.training.global_batch_size, cfg.execution.micro_batch_size,
                      layout.dp_rank, layout.data_parallel)


@contextmanager
def collective_errors(layout: Layout):
    """Turn a failed collective (a dead or stuck peer) into one clear error naming this rank."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        if not layout.distributed:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"rank {layout.rank}: a peer rank died or stopped responding ({first}); "
                               f"stopping") from None


def check_output_dir(cfg: DictConfig) -> None:
    """Refuse an ``output_dir`` that already holds a run (checked on every rank, before any work)."""
    if cfg.output_dir is not None and (Path(cfg.output_dir) / "metrics.jsonl").exists():
        raise ConfigError(f"output_dir: {cfg.output_dir} already holds a run (metrics.jsonl); choose another directory")


def run_directory(cfg: DictConfig) -> Path:
    """``output_dir``, or ``runs/<timestamp>``; never one that already holds a run."""
    check_output_dir(cfg)
    if cfg.output_dir is not None:
        path = Path(cfg.output_dir)
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
    """Train for ``training.steps`` optimizer steps; return the metrics of every step.

    Under torchrun every rank trains its share; rank 0 alone prints progress and writes the run directory.
    """
    data = data_source(cfg)
    check_output_dir(cfg)
    engine = build_engine(cfg, hooks)
    main = engine.layout.is_main
    out = run_directory(cfg) if main else None
    if main:
        (out / "config.yaml").write_text(to_yaml(cfg))
    root = checkpoint_root(cfg, out) if main else (None if cfg.checkpoint.save is None else Path("."))
    steps = cfg.training.steps
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    records = []
    bar = tqdm(range(steps), desc="train", unit="step", disable=not (progress and main), dynamic_ncols=True)
    with open(out / "metrics.jsonl", "w") if main else nullcontext() as metrics, collective_errors(engine.layout):
        for step in bar:
            lr = learning_rate(step, steps, cfg.training.optimizer.learning_rate)
            batch = replica_batch(cfg, data, step, engine.layout)
            start = time.perf_counter()
            result = engine.step(batch, lr)
            record = metrics_record(step + 1, result, lr, tokens, time.perf_counter() - start)
            records.append(record)
            if main:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            bar.set_postfix(loss=f"{result.loss:.3f}", gnorm=f"{result.grad_norm:.2f}", lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            every = cfg.checkpoint.steps
            if every and (step + 1) % every == 0 and step + 1 < steps:
                save(engine, cfg, root, step + 1)
        saved = save(engine, cfg, root, steps)
    if progress and main and records:
        tqdm.write(f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} over {steps} steps; "
                   f"run directory {out}" + (f"; checkpoint {saved}" if saved else ""))
    return records


def benchmark(cfg: DictConfig, hooks: PluginHooks, timed_steps: int = 5) -> dict:
    """The reference's ``main()``: one untimed step, then ``timed_steps`` timed steps."""
    data = data_source(cfg)
    engine = build_engine(cfg, hooks)
    batch = replica_batch(cfg, data, 0, engine.layout)
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
