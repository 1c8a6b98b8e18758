"""ipuft checkpoints: full (layout-free) weights as safetensors, the resolved config, and JSON metadata.

A checkpoint is a directory ``<root>/step-<N>/`` holding:

- ``model.safetensors``: every unit's full (unsharded, layout-free) variables, named
  ``<unit>.<variable>``, e.g. ``decoder.3.attn.q_proj.weight``;
- ``optim.safetensors`` (with ``checkpoint.optim_state``): the optimizer state, ``<unit>.<variable>.<state>``;
- ``state.safetensors``: the RNG states, as byte tensors;
- ``config.yaml`` (the run's config, loadable as a preset), ``meta.json`` (step, Adam's update count, the
  loss-scale state, the data position, the versions of ipuft and its plugins), the run's
  ``tokenizer.json`` when known, and ``manifest.json``: the SHA-256 of every other file.

Saving streams, tensor by tensor, so that it fits in the memory training needs. Every rank takes part in
gathering one variable at a time over DP and TP, in the same order (units in program order; each unit's
weights, then its optimizer state); rank 0 writes each full tensor into its file as it arrives and drops it,
so no rank holds more than about one full tensor beyond its store. The two safetensors files are written in
the same pass by :class:`~ipuft.io.safetensors.SafetensorsWriter`, whose header is computed up front from
the variables' full shapes and stored dtypes. Gathering to full tensors, rather than writing each rank's
shards, keeps the checkpoint layout-free: it resumes under any DP × TP layout, and exports without one.

Checksums are computed as the bytes are written, never by reading the files back, and checked as they are
read, never in a pass of their own: a command verifies exactly the files it reads (export and eval never
touch optim.safetensors). The engine reads units in program order, the order they were written in, so
loading a file is one sequential pass; once the last unit is read the rest of the file is hashed and
compared with the manifest, and a mismatch raises before the caller can use any value it read.

It is written into a temporary directory, fsynced, then renamed, so a crash at any moment leaves the
previous checkpoint intact and never a half-written one under a final name. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft import __version__
from ipuft.components import VariableSpec
from ipuft.errors import CheckpointError, ConfigError
from ipuft.io.safetensors import SafetensorsReader, SafetensorsWriter

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


def sha256_file(path: Path) -> str:
    """The SHA-256 hex digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Contents:
    """The tensors of a checkpoint, in the order they are written.

    ``files`` maps each tensor file (:data:`WEIGHTS`, :data:`OPTIM`) to its tensors' full specs, named
    ``<unit>.<variable>[.<state>]``, in file order: all known before any tensor is gathered, so the headers
    are written first. ``tensors`` yields ``(file, name, full tensor)`` in each file's order (the files
    interleaved as they like), producing each one only when asked for.
    """

    units: list[str]
    files: dict[str, list[VariableSpec]]
    tensors: Iterable[tuple[str, str, torch.Tensor]]

    @classmethod
    def of(cls, weights: dict[str, dict[str, torch.Tensor]],
           optim: dict[str, dict[str, torch.Tensor]] | None = None) -> Contents:
        """Contents from tensors already in memory, per unit (for tools and tests)."""
        groups = {WEIGHTS: weights, **({OPTIM: optim} if optim is not None else {})}
        files = {file: [VariableSpec(f"{unit}.{n}", tuple(t.shape), t.dtype) for unit, ts in units.items()
                        for n, t in ts.items()] for file, units in groups.items()}
        tensors = ((file, f"{unit}.{n}", t) for file, units in groups.items() for unit, ts in units.items()
                   for n, t in ts.items())
        return cls(list(weights), files, tensors)


def _write_small(path: Path, data: bytes) -> str:
    """Write a small file, fsynced; return the SHA-256 of its bytes."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(contents: Contents, cfg: DictConfig, root: Path, step: int, tokenizer: Path | None = None,
                    keep: int | None = None, state: dict | None = None) -> Path:
    """Write checkpoint ``root/step-<step>`` atomically and return its path; keep the newest ``keep``.

    ``contents``' tensors are written as they come, hashed as they are written. ``state``: JSON-ready
    training state (update count, loss scale, data position) stored in meta.json. The RNG states are
    saved too.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    for stale in root.glob(".tmp-step-*"):  # left by a writer that was killed; never a finished checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    try:
        _write_files(contents, cfg, tmp, step, tokenizer, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    # A run resumed from an older checkpoint abandons the ones after it: its newest save is "latest".
    for later in checkpoints(root):
        if _step_of(later) > step:
            shutil.rmtree(later, ignore_errors=True)
    if keep:
        for old in checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_of_run(cfg: DictConfig) -> Path:
    """``checkpoint.load=latest``: the newest checkpoint of the run ``output_dir`` (or ``checkpoint.save``)."""
    if cfg.output_dir is None and cfg.checkpoint.save in (None, DEFAULT_SAVE):
        raise ConfigError("checkpoint.load=latest: set output_dir to the run to resume (or checkpoint.save)")
    root = checkpoint_root(cfg, Path(cfg.output_dir or ".")) or Path(cfg.output_dir) / "checkpoints"
    return find_checkpoint(root)


def _write_files(contents: Contents, cfg: DictConfig, tmp: Path, step: int, tokenizer: Path | None,
                 state: dict | None) -> None:
    """Write every file of a checkpoint into ``tmp``, each fsynced and hashed as it is written; the manifest
    last."""
    writers: dict[str, SafetensorsWriter] = {}
    try:
        for file, specs in contents.files.items():
            writers[file] = SafetensorsWriter(tmp / file, specs, {"format": FORMAT})
        for file, name, tensor in contents.tensors:
            writers[file].write(name, tensor)
        manifest = {file: writer.close() for file, writer in writers.items()}
    finally:
        for writer in writers.values():
            writer.abort()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    with SafetensorsWriter(tmp / STATE, [VariableSpec(k, tuple(t.shape), t.dtype) for k, t in rng.items()],
                           {"format": FORMAT}) as writer:
        for name, tensor in rng.items():
            writer.write(name, tensor)
        manifest[STATE] = writer.close()
    config = OmegaConf.to_container(cfg, resolve=True)
    config["gradient_accumulation"] = None  # derived again on load
    config["checkpoint"]["load"] = None  # a checkpoint's own config starts fresh, not from another one
    manifest["config.yaml"] = _write_small(tmp / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config)).encode())
    if tokenizer is not None and tokenizer.is_file():
        manifest["tokenizer.json"] = _write_small(tmp / "tokenizer.json", tokenizer.read_bytes())
    meta = {"format": FORMAT, "version": 1, "step": step, "units": list(contents.units),
            "optim_state": OPTIM in contents.files, "versions": _versions(), **(state or {})}
    manifest["meta.json"] = _write_small(tmp / "meta.json", json.dumps(meta, indent=2).encode())
    _write_small(tmp / MANIFEST, json.dumps(dict(sorted(manifest.items())), indent=2).encode())


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def checkpoints(root: Path) -> list[Path]:
    """The finished checkpoints under ``root``, oldest first."""
    found = [p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / "meta.json").exists()]
    return sorted(found, key=_step_of)


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


# What a checkpoint's config may not decide for the run that reads it: where that run writes, and where
# its weights come from (the checkpoint itself).
_PLACEMENT = ("output_dir", "checkpoint.save", "model.init_checkpoint")


# Keys that earlier versions saved and that no longer exist: dropped from a checkpoint's config, so that its
# checkpoints stay loadable; and keys that moved, carried to their new place.
RETIRED = ("model.eval",)
MOVED = {f"training.optimizer.{key}": f"plugins.adamw.{key}" for key in ("beta1", "beta2", "eps", "weight_decay")}


# The model's shape, which a checkpoint's weights fix.
SHAPE_KEYS = (
    "model.layers", "model.hidden_size", "model.intermediate_size", "model.embedding.vocab_size",
    "model.attention.heads", "model.attention.rotary_dim", "model.layer_norm_epsilon",
)  # fmt: skip
# What a resumed run must keep from the run it resumes (unless checkpoint.allow_changes lists the key).
RESUME_KEYS = (
    *SHAPE_KEYS, "model.precision", "training.global_batch_size", "training.optimizer.name",
    "training.master_weights", "training.stochastic_rounding", "execution.loss_scaling",
)  # fmt: skip


def _saved(saved: dict, key: str):
    node = saved
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def apply_checkpoint_shapes(cfg: DictConfig, typed: set[str]) -> None:
    """Take the model's shapes from ``model.init_checkpoint``'s config, as a Hugging Face checkpoint's come
    from its config.json: keys the user did not type take the checkpoint's value, and every typed key that
    differs is listed in one error."""
    from omegaconf.errors import OmegaConfBaseException

    found = find_checkpoint(cfg.model.init_checkpoint)
    saved = saved_config_data(found)
    mismatches = []
    for key in SHAPE_KEYS:
        value, current = _saved(saved, key), OmegaConf.select(cfg, key)
        if value is None or value == current:
            continue
        if key in typed:
            mismatches.append(f"{key}={current} but the checkpoint has {str(value)[:40]}")
            continue
        try:
            OmegaConf.update(cfg, key, value)
        except OmegaConfBaseException:
            raise CheckpointError(f"checkpoint {found}: config.yaml: {key} is {str(value)[:40]!r}, not a "
                                  f"{type(current).__name__}") from None
    if mismatches:
        raise ConfigError(f"model.init_checkpoint {found}: {'; '.join(mismatches)} (drop those settings: the "
                          f"checkpoint's weights fix the model's shape)")


def resume_differences(cfg: DictConfig, checkpoint: Path, meta: dict) -> list[str]:
    """What would silently change if ``cfg`` resumed ``checkpoint``: each of :data:`RESUME_KEYS` that differs
    from the checkpoint's config, and optimizer state the checkpoint lacks."""
    saved = saved_config_data(checkpoint)
    allowed = set(cfg.checkpoint.allow_changes)
    found = []
    for key in RESUME_KEYS:
        node = _saved(saved, key)
        mine = OmegaConf.select(cfg, key)
        mine = mine.value if hasattr(mine, "value") else mine
        if key not in allowed and node is not None and node != mine:
            found.append(f"{key} {str(node)[:40]} -> {mine}")
    if cfg.checkpoint.optim_state and not meta["optim_state"] and "checkpoint.optim_state" not in allowed:
        found.append("checkpoint.optim_state: the checkpoint has no optimizer state (Adam would restart from zero)")
    return found


def checkpoint_config(path: str | Path, sections, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a checkpoint (or a run directory's latest) was saved with, set to load that checkpoint
    (``checkpoint.load``), then ``overrides``; ``sections`` are the plugins' config sections.

    The file is untrusted data: it may hold no interpolation (none is ever resolved), and it never
    chooses where the new run writes: ``output_dir`` and ``checkpoint.save`` fall back to their defaults
    unless ``overrides`` set them.
    """
    from ipuft.config import load_config

    found = find_checkpoint(path)
    data = saved_config_data(found)
    for old, new in MOVED.items():
        value = _pop(data, old)
        if value is None or _saved(data, new) is not None or _saved(data, "training.optimizer.name") != "adamw":
            continue
        plugins = data.setdefault("plugins", {})
        section = plugins.setdefault(new.split(".")[1], {}) if isinstance(plugins, dict) else None
        if isinstance(section, dict):  # else the file is malformed there, and loading it says so in one line
            section[new.rpartition(".")[2]] = value
    for key in (*_PLACEMENT, *RETIRED):
        _pop(data, key)
    # A saved config holds every plugin section installed when it was saved; one whose used_when that run did not
    # meet (plugins.adamw in a run of another optimizer) did nothing, and is not a setting of this config.
    saved_sections = data.get("plugins")
    for name in sections or ():
        when = sections.used_when(name)
        if isinstance(saved_sections, dict) and any(
                _saved(data, key) is not None and str(_saved(data, key)) != value for key, value in when.items()):
            saved_sections.pop(name, None)
    return load_config((str(found / "config.yaml"), data), [f"checkpoint.load={found}", *overrides], sections)


def _pop(data: dict, key: str):
    """Remove dotted ``key`` from nested ``data``; its value, or None."""
    parent = _saved(data, key.rpartition(".")[0]) if "." in key else data
    return parent.pop(key.rpartition(".")[2], None) if isinstance(parent, dict) else None


def saved_config_data(checkpoint: Path) -> dict:
    """A checkpoint's config.yaml as data: checked against its manifest first, parsed safely, and refused if
    it holds an interpolation."""
    from ipuft.config import read_config_data

    source = checkpoint / "config.yaml"
    if sha256_file(source) != read_manifest(checkpoint)["config.yaml"]:
        raise CheckpointError(f"checkpoint {checkpoint}: config.yaml does not match its checksum (corrupted)")
    data = read_config_data(source, f"checkpoint {checkpoint}: config.yaml")
    refuse_interpolations(data, str(source))
    return data


def refuse_interpolations(data, source: str, key: str = "") -> None:
    """Raise a :class:`CheckpointError` if any string in ``data`` (parsed YAML or JSON) holds an OmegaConf
    interpolation (``${...}``): a file we read is data, and resolving it could read the environment."""
    if isinstance(data, dict):
        for k, v in data.items():
            refuse_interpolations(v, source, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            refuse_interpolations(v, source, f"{key}[{i}]")
    elif isinstance(data, str) and "${" in data:
        raise CheckpointError(f"{source}: {key or 'a value'} holds an interpolation ({data[:40]!r}); files read "
                              f"from checkpoints are data and are never resolved: remove it")


REQUIRED = (WEIGHTS, STATE, "config.yaml", "meta.json")
OPTIONAL = (OPTIM, "tokenizer.json")
_MANIFEST_LIMIT = 1 << 20  # bytes; a manifest of a few names is far smaller


def read_manifest(checkpoint: Path) -> dict[str, str]:
    """The manifest of ``checkpoint``, checked to name exactly the files the format allows, all present.

    Every entry is one of the checkpoint format's own file names (so never a path that leaves the
    directory) with a SHA-256 hex digest; every required file is listed, and so is every file the
    directory holds. Each must be a regular file, not a link.
    """
    where = f"checkpoint {checkpoint}"
    path = checkpoint / MANIFEST
    try:
        if path.is_symlink() or not path.is_file():
            raise FileNotFoundError
        if path.stat().st_size > _MANIFEST_LIMIT:
            raise CheckpointError(f"{where}/{MANIFEST} is larger than {_MANIFEST_LIMIT} bytes: not a manifest")
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where} has no {MANIFEST}: it is incomplete") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}/{MANIFEST} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}/{MANIFEST} must be a JSON object of file name -> SHA-256")
    allowed = REQUIRED + OPTIONAL
    for name, digest in manifest.items():
        if name not in allowed:
            raise CheckpointError(f"{where}/{MANIFEST} lists {name[:80]!r}, which is not a file of the checkpoint "
                                  f"format ({', '.join(allowed)})")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise CheckpointError(f"{where}/{MANIFEST}: the checksum of {name} is not a SHA-256 hex digest")
    missing = [name for name in REQUIRED if name not in manifest]
    if missing:
        raise CheckpointError(f"{where}/{MANIFEST} does not list {', '.join(missing)}: every checkpoint file must "
                              f"be checksummed")
    try:
        present = {p.name for p in checkpoint.iterdir()} - {MANIFEST}
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be listed ({exc})") from None
    unlisted = sorted(present - set(manifest))
    if unlisted:
        raise CheckpointError(f"{where} holds {', '.join(unlisted)}, not listed in its {MANIFEST}")
    for name in manifest:
        file = checkpoint / name
        if file.is_symlink() or not file.is_file():
            what = "a link" if file.is_symlink() else ("missing" if not file.exists() else "not a regular file")
            raise CheckpointError(f"{where}: {name}, listed in its manifest, is {what}")
    return manifest


def verify(checkpoint: Path) -> None:
    """Check every file of a checkpoint against its manifest; a missing, unlisted or altered one is an error.

    For tests and tools: commands verify the files they read as they read them (:func:`read_verified`,
    :func:`open_tensors`), and never hash a file they do not read."""
    for name, digest in read_manifest(checkpoint).items():
        if sha256_file(checkpoint / name) != digest:
            raise CheckpointError(f"checkpoint {checkpoint}: {name} does not match its checksum (corrupted)")


def read_verified(checkpoint: Path, name: str, limit: int) -> bytes:
    """The bytes of small file ``name`` of ``checkpoint`` (at most ``limit``), read once and checked against
    its manifest entry."""
    manifest = read_manifest(checkpoint)
    path = checkpoint / name
    if name not in manifest:
        raise CheckpointError(f"checkpoint {checkpoint} has no {name}")
    try:
        if path.stat().st_size > limit:
            raise CheckpointError(f"{path} is larger than {limit} bytes: not a checkpoint's {name}")
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if hashlib.sha256(data).hexdigest() != manifest[name]:
        raise CheckpointError(f"checkpoint {checkpoint}: {name} does not match its checksum (corrupted)")
    return data


def open_tensors(checkpoint: Path, file: str, manifest: dict[str, str] | None = None) -> SafetensorsReader:
    """A reader of tensor file ``file`` of ``checkpoint``, its header checked now and its bytes verified
    against the manifest as they are read (:class:`~ipuft.io.safetensors.SafetensorsReader`)."""
    manifest = manifest if manifest is not None else read_manifest(checkpoint)
    if file not in manifest:
        raise CheckpointError(f"checkpoint {checkpoint} has no {file}")
    return SafetensorsReader(checkpoint / file, f"checkpoint {checkpoint}: {file}", manifest[file])


_META_LIMIT = 1 << 20  # bytes
_MAX_COUNT = 1 << 53  # steps, updates and samples beyond this are not a real run's


def _integer(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MAX_COUNT


def _meta_problem(meta) -> str | None:
    """What is wrong with a parsed meta.json, naming the field and what would be right; None if nothing."""
    if not isinstance(meta, dict):
        return "must be a JSON object"
    if meta.get("format") != FORMAT:
        return f"is not an ipuft checkpoint (format {str(meta.get('format'))[:40]!r})"
    if not _integer(meta.get("step")):
        return f"step must be an integer in [0, 2^53], got {str(meta.get('step'))[:40]}"
    if "updates" in meta and not (_integer(meta["updates"]) and meta["updates"] <= meta["step"]):
        return f"updates must be an integer in [0, step={meta['step']}], got {str(meta['updates'])[:40]}"
    if not isinstance(meta.get("units"), list) or not all(isinstance(u, str) for u in meta["units"]):
        return "units must be a list of unit names"
    if not isinstance(meta.get("optim_state"), bool):
        return "optim_state must be true or false"
    scale = meta.get("loss_scale")
    if scale is not None:
        if not (isinstance(scale, dict) and set(scale) == {"scale", "dynamic", "growth_interval", "clean_steps"}):
            return "loss_scale must be an object of scale, dynamic, growth_interval and clean_steps"
        number = scale["scale"]
        if not (isinstance(number, (int, float)) and not isinstance(number, bool) and 0 < number < float("inf")):
            return f"loss_scale.scale must be a finite number > 0, got {str(number)[:40]}"
        if not isinstance(scale["dynamic"], bool) or not _integer(scale["growth_interval"], 1) \
                or not _integer(scale["clean_steps"]):
            return "loss_scale: dynamic must be a boolean, growth_interval an integer > 0, clean_steps >= 0"
    data = meta.get("data")
    if data is not None:
        if not isinstance(data, dict):
            return "data must be an object"
        for key, value in data.items():
            if not _integer(value):
                return f"data.{str(key)[:40]} must be an integer >= 0, got {str(value)[:40]}"
    return None


def read_meta(checkpoint: Path) -> dict:
    """A checkpoint's meta.json, checked against its manifest, with every field the training state is
    restored from checked."""
    path = checkpoint / "meta.json"
    data = read_verified(checkpoint, "meta.json", _META_LIMIT)
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from None
    problem = _meta_problem(meta)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    return meta


def checkpoint_initializer(checkpoint: Path, file: str = WEIGHTS,
                           units: Iterable[str] | None = None) -> Callable[[str, list[VariableSpec]], dict]:
    """An engine initializer reading each unit's full weights from the checkpoint, tensor by tensor
    (``file=OPTIM``: its optimizer state, with specs named ``<variable>.<state>``). A unit's ``out`` may hold
    tensors of the full shape and dtype to read into, which are then the values returned.

    The file is verified as it is read: once every unit of ``units`` (by default the checkpoint's) has been
    asked for, the rest of the file is hashed and compared with the manifest, and a mismatch raises from
    that last call, so no caller ever holds all of a damaged file's values. Asked in the order the units
    were saved (program order), the file is read in one sequential pass.
    """
    manifest = read_manifest(checkpoint)
    meta = read_meta(checkpoint)
    reader = open_tensors(checkpoint, file, manifest)
    pending = set(meta["units"] if units is None else units)
    source = f"checkpoint {checkpoint}"

    def initial(unit: str, specs: list[VariableSpec],
                out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        values = {}
        for spec in specs:
            name = f"{unit}.{spec.name}"
            if name not in reader:
                raise CheckpointError(f"{source} lacks {name}: it is of another model")
            entry = reader.entries[name]
            if entry.shape != tuple(spec.shape):
                raise CheckpointError(f"{source}: {name} has shape {entry.shape}, the model expects "
                                      f"{tuple(spec.shape)}")
            home = (out or {}).get(spec.name)
            if home is not None and home.dtype == entry.dtype == spec.dtype:
                values[spec.name] = reader.get(name, out=home)  # read in place: no copy
            else:
                values[spec.name] = reader.get(name).to(spec.dtype)
        pending.discard(unit)
        if not pending:
            reader.finish()
        return values

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
    """Set the RNG states a checkpoint saved (its state.safetensors, verified as it is read)."""
    reader = open_tensors(checkpoint, STATE)
    expected = torch.get_rng_state()
    saved = reader.entries.get("torch")
    if saved is None or saved.dtype != expected.dtype or saved.shape != tuple(expected.shape):
        reader.close()
        raise CheckpointError(f"{checkpoint / STATE}: 'torch' must be the CPU generator's state, a uint8 tensor of "
                              f"shape {tuple(expected.shape)}")
    cpu = reader.get("torch")
    cuda = reader.get("cuda") if "cuda" in reader else None
    reader.finish()
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
