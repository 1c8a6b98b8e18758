"""ipuft checkpoints: full (layout-free) weights as safetensors, the resolved config, and JSON metadata.

A checkpoint is a directory ``<root>/step-<N>/`` holding:

- ``model.safetensors``: every unit's full (unsharded, layout-free) variables, named
  ``<unit>.<variable>``, e.g. ``decoder.3.attn.q_proj.weight``;
- ``optim.safetensors`` (with ``checkpoint.optim_state``): the optimizer state, ``<unit>.<variable>.<state>``;
- ``state.safetensors``: the RNG states, as byte tensors;
- ``config.yaml`` (the run's config, loadable as a preset), ``meta.json`` (step, Adam's update count, the
  loss-scale state, the data position, the versions of ipuft and its plugins), the model's own files where
  it has them (its tokenizer's and its source's config.json as ``hf_config.json``:
  :mod:`ipuft.io.model_files`), and ``manifest.json``: the SHA-256 of every other file.

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

This module is the format alone: what is written, and how what is read is checked. A checkpoint's config as a
config is :mod:`ipuft.config.migrate` (read safely, migrated) and :func:`ipuft.config.load.checkpoint_config`;
what a run saves in one and what resuming it restores and may not change is :mod:`ipuft.run.resume`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft import __version__
from ipuft.components import VariableSpec
from ipuft.errors import CheckpointError, shown
from ipuft.io.files import open_regular, read_bounded, read_json
from ipuft.io.safetensors import SafetensorsReader, SafetensorsWriter

FORMAT = "ipuft-checkpoint"
DEFAULT_SAVE = "<output_dir>/checkpoints"
WEIGHTS = "model.safetensors"
OPTIM = "optim.safetensors"
STATE = "state.safetensors"
MANIFEST = "manifest.json"
# The model's own small files, as its source had them (read, checked and written back by
# :mod:`ipuft.io.model_files`): the tokenizer's, and the source's config.json (kept as hf_config.json, so that
# a checkpoint is never taken for a Hugging Face directory) with its generation_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SOURCE_CONFIG = "hf_config.json"
SOURCE_FILES = (SOURCE_CONFIG, "generation_config.json")
MODEL_FILES = TOKENIZER_FILES + SOURCE_FILES
# A preference run's reference log-probabilities (:mod:`ipuft.run.reference`), carried by each of its checkpoints.
REFERENCE = "reference_logps.safetensors"


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
    with open_regular(path, str(path)) as f:
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


def save_checkpoint(contents: Contents, cfg: DictConfig, root: Path, step: int,
                    files: Mapping[str, bytes] | None = None, keep: int | None = None,
                    state: dict | None = None) -> Path:
    """Write checkpoint ``root/step-<step>`` atomically and return its path; keep the newest ``keep``.

    ``contents``' tensors are written as they come, hashed as they are written. ``files``: the model's own
    files (:data:`MODEL_FILES`, checked by the caller), by name. ``state``: JSON-ready
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
        _write_files(contents, cfg, tmp, step, files or {}, state)
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


def _write_files(contents: Contents, cfg: DictConfig, tmp: Path, step: int, files: Mapping[str, bytes],
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
    for name, data in files.items():
        if name not in (*MODEL_FILES, REFERENCE):
            raise ValueError(f"{name!r} is not one of a checkpoint's model files ({', '.join(MODEL_FILES)}) or "
                             f"{REFERENCE}")
        manifest[name] = _write_small(tmp / name, data)
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


REQUIRED = (WEIGHTS, STATE, "config.yaml", "meta.json")
OPTIONAL = (OPTIM, *MODEL_FILES, REFERENCE)
_MANIFEST_LIMIT = 1 << 20  # bytes; a manifest of a few names is far smaller


def read_manifest(checkpoint: Path) -> dict[str, str]:
    """The manifest of ``checkpoint``, checked to name exactly the files the format allows, all present.

    Every entry is one of the checkpoint format's own file names (so never a path that leaves the
    directory) with a SHA-256 hex digest; every required file is listed, and so is every file the
    directory holds. Each must be a regular file, not a link.
    """
    where = f"checkpoint {checkpoint}"
    path = checkpoint / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(f"{where} has no {MANIFEST}: it is incomplete")
    manifest = read_json(path, _MANIFEST_LIMIT, f"{where}/{MANIFEST}", hint=": not a manifest")
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
    data = read_bounded(path, limit, str(path), hint=f": not a checkpoint's {name}")
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
        return f"step must be an integer in [0, 2^53], got {shown(meta.get('step'))}"
    if "updates" in meta and not (_integer(meta["updates"]) and meta["updates"] <= meta["step"]):
        return f"updates must be an integer in [0, step={meta['step']}], got {shown(meta['updates'])}"
    if not isinstance(meta.get("units"), list) or not all(isinstance(u, str) for u in meta["units"]):
        return "units must be a list of unit names"
    if not isinstance(meta.get("optim_state"), bool):
        return "optim_state must be true or false"
    if "optimizer" in meta and not (isinstance(meta["optimizer"], str) and meta["optimizer"]):
        return f"optimizer must name the optimizer whose state the checkpoint holds, got {shown(meta['optimizer'])}"
    scale = meta.get("loss_scale")
    if scale is not None:
        if not (isinstance(scale, dict) and set(scale) == {"scale", "dynamic", "growth_interval", "clean_steps"}):
            return "loss_scale must be an object of scale, dynamic, growth_interval and clean_steps"
        number = scale["scale"]
        if not (isinstance(number, (int, float)) and not isinstance(number, bool) and 0 < number < float("inf")):
            return f"loss_scale.scale must be a finite number > 0, got {shown(number)}"
        if not isinstance(scale["dynamic"], bool) or not _integer(scale["growth_interval"], 1) \
                or not _integer(scale["clean_steps"]):
            return "loss_scale: dynamic must be a boolean, growth_interval an integer > 0, clean_steps >= 0"
    data = meta.get("data")
    if data is not None:
        if not isinstance(data, dict):
            return "data must be an object"
        for key, value in data.items():
            if not _integer(value):
                return f"data.{str(key)[:40]} must be an integer >= 0, got {shown(value)}"
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


def checkpoint_initializer(checkpoint: Path, file: str = WEIGHTS, units: Iterable[str] | None = None,
                           exact: str | None = None) -> Callable[[str, list[VariableSpec]], dict]:
    """An engine initializer reading each unit's full weights from the checkpoint, tensor by tensor
    (``file=OPTIM``: its optimizer state, with specs named ``<variable>.<state>``). A unit's ``out`` may hold
    tensors of the full shape and dtype to read into, which are then the values returned.

    The file is verified as it is read: once every unit of ``units`` (by default the checkpoint's) has been
    asked for, the rest of the file is hashed and compared with the manifest, and a mismatch raises from
    that last call, so no caller ever holds all of a damaged file's values. Asked in the order the units
    were saved (program order), the file is read in one sequential pass.

    ``exact`` (the optimizer's name, for its state): every tensor must be of the spec's dtype too, not cast
    into it (an 8-bit code cast to float32 is no moment); the file's header records each one's dtype and shape.
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
            if exact is not None and entry.dtype != spec.dtype:
                raise CheckpointError(f"{source}: {file} holds {name} as {str(entry.dtype).removeprefix('torch.')}, "
                                      f"optimizer {exact} keeps it as {str(spec.dtype).removeprefix('torch.')}: it "
                                      f"is another optimizer's state; start from the weights with "
                                      f"model.init_checkpoint={checkpoint}")
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
