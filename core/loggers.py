"""Logging backends: where a run's config, every step's metrics and its end go, besides metrics.jsonl.

``metrics.jsonl`` is built in and always written (resume reads it back); ``logging.backends`` adds the
backends plugins registered through ``ipuft_register_loggers``. Two ship with ipuft as built-in plugins:
``tensorboard`` (``pip install ipuft[tensorboard]``) and ``wandb`` (offline; ``pip install ipuft[wandb]``).
A backend that fails, to start or later, costs one warning line and is dropped: training goes on.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ipuft import hookimpl
from ipuft.errors import described
from ipuft.registry import NamedRegistry

JSONL = "jsonl"  # the built-in metrics.jsonl, always written; naming it in logging.backends is allowed


class Logger(ABC):
    """One backend. It is built on rank 0 with the resolved config and the run directory."""

    @abstractmethod
    def start(self, config: dict[str, Any]) -> None:
        """The run's resolved config, as plain data, once before the first step."""

    @abstractmethod
    def log(self, step: int, record: dict[str, Any]) -> None:
        """The metrics of optimizer step ``step``: the record metrics.jsonl gets (numbers and nested dicts)."""

    @abstractmethod
    def finish(self, status: str) -> None:
        """The end of the run: ``finished``, ``stopped`` (a signal) or ``failed``."""


LoggerFactory = Callable[[DictConfig, Path], Logger]


class LoggerRegistry(NamedRegistry):
    """Every logging backend the installed plugins registered (``add(name, build)``, ``build(cfg, run_dir)``)."""

    kind = "logging backend"
    key = "logging.backends"


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics record, flattened with ``/``: ``traffic.h2d.fwd`` → ``traffic/h2d/fwd``."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out


class Backends:
    """The run's backends: each call goes to every backend still alive; one that raises is warned about in one
    line on stderr and dropped."""

    def __init__(self, cfg: DictConfig, run_dir: Path, registry: LoggerRegistry) -> None:
        self.active: dict[str, Logger] = {}
        for name in cfg.logging.backends:
            if name != JSONL:
                builder = registry.get(name)
                self._guard(name, lambda b=builder: self.active.__setitem__(b.name, b.build(cfg, run_dir)))
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        for name, backend in list(self.active.items()):
            self._guard(name, lambda b=backend: b.start(config))

    def _guard(self, name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 (a logging backend never stops training)
            self.active.pop(name, None)
            sys.stderr.write(f"ipuft: warning: logging backend {name!r} failed and is off for this run: "
                             f"{described(exc, 200)}\n")

    def log(self, step: int, record: dict[str, Any]) -> None:
        for name, backend in list(self.active.items()):
            self._guard(name, lambda b=backend: b.log(step, record))

    def finish(self, status: str) -> None:
        for name, backend in list(self.active.items()):
            self._guard(name, lambda b=backend: b.finish(status))


# ---- the shipped backends (registered as the built-in plugin "ipuft.loggers") ---------------------------


class TensorBoard(Logger):
    """Event files under ``<run>/tensorboard``: every number of each step's record as a scalar, the config
    as text."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("tensorboard is not installed; pip install 'ipuft[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def start(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + OmegaConf.to_yaml(OmegaConf.create(config)) + "```")

    def log(self, step: int, record: dict[str, Any]) -> None:
        for tag, value in scalars({k: v for k, v in record.items() if k != "step"}).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class WandB(Logger):
    """Weights & Biases in offline mode, under ``<run>/wandb`` (``wandb sync`` uploads it later)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb is not installed; pip install 'ipuft[wandb]'") from None
        self.wandb, self.run_dir, self.run = wandb, run_dir, None

    def start(self, config: dict[str, Any]) -> None:
        self.run = self.wandb.init(mode="offline", dir=str(self.run_dir), config=config)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(scalars({k: v for k, v in record.items() if k != "step"}), step=step)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


@hookimpl
def ipuft_register_loggers(registry: LoggerRegistry) -> None:
    registry.add("tensorboard", lambda cfg, run_dir: TensorBoard(run_dir),
                 "TensorBoard event files (ipuft[tensorboard])")
    registry.add("wandb", lambda cfg, run_dir: WandB(run_dir), "Weights & Biases, offline (ipuft[wandb])")
