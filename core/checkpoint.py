"""ipuft checkpoints: full (layout-free) weights as safetensors, the resolved config, and JSON metadata.

A checkpoint is a directory ``<root>/step-<N>/`` holding:

- ``model.safetensors``: every unit's full (unsharded, layout-free) variables, named
  ``<unit>.<variable>``, e.g. ``decoder.3.attn.q_proj.weight``;
- ``optim.safetensors`` (with ``checkpoint.optim_state``): the optimizer state, ``<unit>.<variable>.<state>``;
- ``state.safetensors``: the RNG states, as byte tensors;
- ``config.yaml`` (the run's config, loadable as a preset), ``meta.json`` (step, Adam's update count, the
  loss-scale state, the data position, the versions of ipuft and its plugins), the run's
  ``tokenizer.json`` when known, and ``manifest.json``: the SHA-256 of every other file, checked on load.

It is written into a temporary directory, fsynced, then renamed, so a crash at any moment leaves the
previous checkpoint intact and never a half-written one under a final name. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Container
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft import __version__
from ipuft.components import VariableSpec
from ipuft.errors import CheckpointError

FORMAT = "ipuft-checkpoint"
DEFAULT_SAVE = "<output_dir>/checkpoints"
WEIGHTS = "model.safetensors"
OPTIM = "optim.safetensors"
STATE = "state.safetensors"
MANIFEST = "manifest.json"


def checkpoint_root(cfg: DictConfig, run_dir: Path) -> Path | None:
    """Where this run saves checkpoints: ``checkpoint.save``, by default inside the run directory."""
    save = cfg.checkpoint.save
    if save is None:
        return None
    return run_dir / "checkpoints" if save == DEFAULT_SAVE else Path(save)


def _versions() -> dict[str, str]:
    """ipuft's version and that of every distribution that declares an ipuft plugin."""
    out = {"ipuft": __version__}
    for ep in metadata.entry_points(group="ipuft"):
        if ep.dist is not None:
            out[ep.dist.metadata["Name"]] = ep.dist.version
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flat(units: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{unit}.{name}": t.contiguous() for unit, w in units.items() for name, t in w.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(full_weights: dict[str, dict[str, torch.Tensor]], cfg: DictConfig, root: Path, step: int,
                    tokenizer: Path | None = None, keep: int | None = None,
                    optim: dict[str, dict[str, torch.Tensor]] | None = None, state: dict | None = None) -> Path:
    """Write checkpoint ``root/step-<step>`` atomically and return its path; keep the newest ``keep``.

    ``optim``: full optimizer state per unit; ``state``: JSON-ready training state (update count, loss
    scale, data position) stored in meta.json. The RNG states are saved too.
    """
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    for stale in root.glob(".tmp-step-*"):  # left by a writer that was killed; never a finished checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    save_file(_flat(full_weights), str(tmp / WEIGHTS), metadata={"format": FORMAT})
    if optim is not None:
        save_file(_flat(optim), str(tmp / OPTIM), metadata={"format": FORMAT})
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / STATE), metadata={"format": FORMAT})
    config = OmegaConf.to_container(cfg, resolve=True)
    config["gradient_accumulation"] = None  # derived again on load
    config["checkpoint"]["load"] = None  # a checkpoint's own config starts fresh, not from another one
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    if tokenizer is not None and tokenizer.is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    meta = {"format": FORMAT, "version": 1, "step": step, "units": list(full_weights),
            "optim_state": optim is not None, "versions": _versions(), **(state or {})}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    manifest = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
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
        if root.is_dir() and (found := checkpoints(root)):
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"{path} is neither an ipuft checkpoint (no meta.json) nor a run directory with checkpoints")


def checkpoint_config(path: str | Path, sections, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a checkpoint (or a run directory's latest) was saved with, set to load that checkpoint
    (``checkpoint.load``), then ``overrides``; ``sections`` are the plugins' config sections."""
    from ipuft.config import load_config

    found = find_checkpoint(path)
    return load_config(str(found / "config.yaml"), [f"checkpoint.load={found}", *overrides], sections)


def verify(checkpoint: Path) -> None:
    """Check every file of a checkpoint against its manifest; a missing or altered one is an error."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {checkpoint} has no {MANIFEST}: it is incomplete") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}/{MANIFEST} cannot be read ({exc})") from None
    for name, digest in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {checkpoint} lacks {name}, listed in its manifest")
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint {checkpoint}: {name} does not match its checksum (corrupted)")


def read_meta(checkpoint: Path) -> dict:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{checkpoint}/meta.json cannot be read ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{checkpoint}/meta.json is not an ipuft checkpoint (format {meta.get('format')!r})")
    return meta


def checkpoint_initializer(checkpoint: Path, file: str = WEIGHTS,
                           verify_files: bool = True) -> Callable[[str, list[VariableSpec]], dict]:
    """An engine initializer reading each unit's full weights from the checkpoint, tensor by tensor
    (``file=OPTIM``: its optimizer state, with specs named ``<variable>.<state>``). The checkpoint's
    checksums are verified first unless ``verify_files`` is false."""
    from safetensors import safe_open

    if verify_files:
        verify(checkpoint)
    read_meta(checkpoint)
    try:
        handle = safe_open(str(checkpoint / file), framework="pt", device="cpu")
        names = set(handle.keys())
    except Exception as exc:  # noqa: BLE001 (safetensors' own errors, reported as one line)
        raise CheckpointError(f"{checkpoint / file} cannot be read: {type(exc).__name__}: {exc}") from None

    def initial(unit: str, specs: list[VariableSpec]) -> dict[str, torch.Tensor]:
        return {spec.name: checked(spec, f"{unit}.{spec.name}", names, handle.get_tensor, f"checkpoint {checkpoint}")
                for spec in specs}

    return initial


def checked(spec: VariableSpec, name: str, available: Container[str], get: Callable[[str], torch.Tensor],
            source: str) -> torch.Tensor:
    """Variable ``spec``, read as ``name`` from ``source`` by ``get`` (if ``available`` has it), checked and cast."""
    if name not in available:
        raise CheckpointError(f"{source} lacks {name}: it is of another model")
    tensor = get(name)
    if tuple(tensor.shape) != spec.shape:
        raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, the model expects {spec.shape}")
    return tensor.to(spec.dtype)


def restore_rng(checkpoint: Path) -> None:
    """Set the RNG states a checkpoint saved."""
    from safetensors.torch import load_file

    rng = load_file(str(checkpoint / STATE))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
