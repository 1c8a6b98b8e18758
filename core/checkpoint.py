"""ipuft checkpoints: full (layout-free) weights as safetensors, the resolved config, and JSON metadata.

A checkpoint is a directory ``<root>/step-<N>/`` holding ``model.safetensors`` (every unit's full
variables, named ``<unit>.<variable>``, e.g. ``decoder.3.attn.q_proj.weight``), ``config.yaml`` (the
run's config, loadable as a preset), ``meta.json`` and, when known, the run's ``tokenizer.json``. It is
written into a temporary directory, fsynced, then renamed, so a crash never leaves a half-written
checkpoint under a final name. Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft.components import VariableSpec
from ipuft.errors import CheckpointError

FORMAT = "ipuft-checkpoint"
DEFAULT_SAVE = "<output_dir>/checkpoints"
WEIGHTS = "model.safetensors"


def checkpoint_root(cfg: DictConfig, run_dir: Path) -> Path | None:
    """Where this run saves checkpoints: ``checkpoint.save``, by default inside the run directory."""
    save = cfg.checkpoint.save
    if save is None:
        return None
    return run_dir / "checkpoints" if save == DEFAULT_SAVE else Path(save)


def _versions() -> dict[str, str]:
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name == "ipuft" or name.startswith("ipuft-"):
            out[name] = dist.version
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(full_weights: dict[str, dict[str, torch.Tensor]], cfg: DictConfig, root: Path, step: int,
                    tokenizer: Path | None = None, keep: int | None = None) -> Path:
    """Write checkpoint ``root/step-<step>`` atomically and return its path; keep the newest ``keep``."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {f"{unit}.{name}": t.contiguous() for unit, w in full_weights.items() for name, t in w.items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT})
    config = OmegaConf.to_container(cfg, resolve=True)
    config["gradient_accumulation"] = None  # derived again on load
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    if tokenizer is not None and tokenizer.is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    meta = {"format": FORMAT, "version": 1, "step": step, "units": list(full_weights), "versions": _versions()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    for file in tmp.iterdir():
        _fsync(file)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    if keep:
        for old in checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(root: Path) -> list[Path]:
    """The finished checkpoints under ``root``, oldest first."""
    found = [p for p in root.glob("step-*") if (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest checkpoint of a run directory or checkpoint root."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir() and checkpoints(root):
            return checkpoints(root)[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"{path} is neither an ipuft checkpoint (no meta.json) nor a run directory with checkpoints")


def read_meta(checkpoint: Path) -> dict:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{checkpoint}/meta.json cannot be read ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}/meta.json is not an ipuft checkpoint (format {meta.get('format')!r})")
    return meta


def checkpoint_initializer(checkpoint: Path) -> Callable[[str, list[VariableSpec]], dict[str, torch.Tensor]]:
    """An engine initializer reading each unit's full weights from the checkpoint, tensor by tensor."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(checkpoint / WEIGHTS), framework="pt", device="cpu")
        names = set(handle.keys())
    except Exception as exc:
        raise CheckpointError(f"{checkpoint / WEIGHTS} cannot be read: {type(exc).__name__}: {exc}") from None

    def initial(unit: str, specs: list[VariableSpec]) -> dict[str, torch.Tensor]:
        out = {}
        for spec in specs:
            name = f"{unit}.{spec.name}"
            if name not in names:
                raise CheckpointError(f"checkpoint {checkpoint} lacks {name}: it is of another model")
            tensor = handle.get_tensor(name)
            if tuple(tensor.shape) != spec.shape:
                raise CheckpointError(f"checkpoint {checkpoint}: {name} has shape {tuple(tensor.shape)}, the model "
                                      f"expects {spec.shape}")
            out[spec.name] = tensor.to(spec.dtype)
        return out

    return initial
