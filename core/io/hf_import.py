"""Local Hugging Face directories: their config.json, read through its model family (:mod:`ipuft.families`),
and their weights streamed one tensor at a time (safetensors, possibly sharded with an index, or
``pytorch_model*.bin`` loaded with ``weights_only=True`` and memory-mapped). Nothing here ever reaches the network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ipuft.components import HasFusedTensors, VariableSpec
from ipuft.errors import CheckpointError, ConfigError, PluginError, described, shown
from ipuft.families import HFConfigError, ModelFamily, ModelFamilyRegistry, check_config_fields, config_int
from ipuft.io.checkpoint import checked
from ipuft.io.files import read_json, read_text, require_regular
from ipuft.io.hf_names import split_rows, unit_fused, unit_mappings

_CONFIG_LIMIT = 1 << 20  # bytes; a config.json is a few kB


def _read_json(path: Path, limit: int, key: str = "") -> object:
    """The JSON value in ``path`` (an untrusted regular file of at most ``limit`` bytes, read as data); one line
    naming it (after ``key``, the config key that led there) if it is larger, not a regular file, or not JSON."""
    return read_json(path, limit, f"{key}{path}", hint="; such a file is a few kB")


def hub_cache_dirs() -> list[Path]:
    """Where a Hugging Face hub cache may be, as huggingface_hub looks: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return [home / "hub"]


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_REVISION = re.compile(r"^[0-9a-f]{40}$")
_REF_LIMIT = 1 << 10  # bytes; refs/main is a 40-hex commit


def resolve_hf_directory(spec: str) -> Path:
    """``model.hf_checkpoint`` as a local directory: the directory itself, or a hub name (``org/name``)
    found in the local Hugging Face cache, at the snapshot its ``refs/main`` names, as transformers does
    with ``local_files_only=True``. Nothing is downloaded; a miss says where it looked."""
    path = Path(spec).expanduser()
    if path.is_dir() or not _REPO_ID.match(spec) or path.exists():
        return path
    looked = []
    for cache in hub_cache_dirs():
        repo = cache / f"models--{spec.replace('/', '--')}"
        looked.append(str(repo))
        if not (repo / "snapshots").is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.exists() or ref.is_symlink():  # a 40-hex commit and a newline; anything else is refused below
            revision = read_text(ref, _REF_LIMIT, f"model.hf_checkpoint: {ref}", hint="; it names one snapshot").strip()
        else:
            snapshots = sorted(p.name for p in (repo / "snapshots").iterdir() if _REVISION.match(p.name))
            revision = snapshots[0] if len(snapshots) == 1 else ""
        if not _REVISION.match(revision):  # refs/main is data: it may only name a snapshot, never a path
            raise CheckpointError(f"model.hf_checkpoint: {repo}/refs/main does not name one snapshot (a 40-hex "
                                  f"commit); download {spec} again")
        snapshot = repo / "snapshots" / revision
        if snapshot.is_dir():
            return snapshot
    raise CheckpointError(f"model.hf_checkpoint: {spec} is neither a directory nor in the local Hugging Face cache "
                          f"(looked in {', '.join(looked)}; set HF_HOME or HF_HUB_CACHE); ipuft never downloads: "
                          f"fetch it where there is network (huggingface-cli download {spec}) and copy the cache "
                          f"or the snapshot directory here")


def read_hf_config(directory: str | Path, families: ModelFamilyRegistry | None) -> tuple[ModelFamily, dict]:
    """The family and the config.json of a local Hugging Face directory: a JSON object (untrusted, read as
    data: nothing in it is resolved) whose ``model_type`` an installed plugin reads."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"model.hf_checkpoint: {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"model.hf_checkpoint: {path} has no config.json")
    config = _read_json(config_file, _CONFIG_LIMIT, "model.hf_checkpoint: ")
    if not isinstance(config, dict):
        raise CheckpointError(f"model.hf_checkpoint: {config_file} must be a JSON object")
    model_type = config.get("model_type")
    known = families.names() if families is not None else []
    if not isinstance(model_type, str) or model_type not in known:
        raise CheckpointError(f"model.hf_checkpoint: {config_file} has model_type {str(model_type)[:40]!r}; the "
                              f"installed plugins read {', '.join(repr(k) for k in known) or 'none'}")
    try:
        check_config_fields(config)
    except HFConfigError as exc:
        raise CheckpointError(f"model.hf_checkpoint: {config_file}: {exc}") from None
    return families.get(model_type), config


def _special_tokens(config: dict, vocab_size: int) -> dict[str, Any]:
    """config.json's ``bos_token_id`` and ``eos_token_id`` (an id, a list of ids, or null) as
    ``model.bos_token_id`` and ``model.eos_token_ids``, each a token of the model's ``vocab_size``."""
    def token(value: object, key: str) -> int:
        token_id = config_int({key: value}, key, minimum=0)
        if token_id >= vocab_size:
            raise HFConfigError(f"{key}={token_id} is outside the vocabulary (vocab_size={vocab_size}: ids 0 to "
                                f"{vocab_size - 1})")
        return token_id

    out: dict[str, Any] = {}
    bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    if bos is not None:
        out["model.bos_token_id"] = token(bos, "bos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or len(ids) > 64:
            raise HFConfigError(f"eos_token_id must be a token id or a list of 1 to 64 ids, got {shown(eos)}")
        out["model.eos_token_ids"] = [token(i, "eos_token_id") for i in ids]
    return out


def apply_hf_shapes(cfg: DictConfig, typed: set[str], families: ModelFamilyRegistry | None,
                    notes: list[str] | None = None) -> tuple[str, int] | None:
    """Take the model from ``model.hf_checkpoint``'s config.json: the checkpoint defines it.

    The family of its ``model_type`` reads it into config keys (``model.family``, the shapes, the family's
    own settings), and sets the components, unless the user chose others (a LoRA decoder, say), and the
    special tokens. A key the user did not type (``typed``: their overrides, and the keys of a YAML file of
    theirs; not a shipped preset's) takes the checkpoint's value; a typed key with another value is a
    mismatch, and every mismatch is listed in one error. A tied config.json whose weights hold a head of their
    own is read as transformers reads it (:func:`tied_head`; its note appended to ``notes``). Returns the
    family's positions key and its value in config.json, if it has one (an untyped ``model.sequence_length``
    is capped at it).
    """
    family, config = read_hf_config(cfg.model.hf_checkpoint, families)
    source = f"model.hf_checkpoint: {Path(cfg.model.hf_checkpoint) / 'config.json'}"
    try:
        settings = {"model.family": family.model_type, **family.read_config(config)}
        vocab = settings.get("model.embedding.vocab_size", cfg.model.embedding.vocab_size)
        settings.update(_special_tokens(config, vocab))
        positions = config_int(config, family.positions_key, None) if family.positions_key else None
    except HFConfigError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (the family plugin's bug on odd input: one line naming it)
        raise PluginError(f"model family {family.model_type!r} of plugin {family.plugin!r} failed to read "
                          f"{source}: {described(exc)}") from None
    for role, name in family.components.items():
        if f"model.{role}" not in typed:
            OmegaConf.update(cfg, f"model.{role}", name)
    mismatches = []
    for key, value in settings.items():
        current = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(current):
            current = OmegaConf.to_container(current)
        if current == value:
            continue
        if key not in typed:
            try:
                OmegaConf.update(cfg, key, value, merge=True)
            except OmegaConfBaseException as exc:
                raise PluginError(f"model family {family.model_type!r} of plugin {family.plugin!r} sets {key}, "
                                  f"which the config does not take ({str(exc).splitlines()[0]})") from None
        else:
            mismatches.append(f"{key}={current} but the checkpoint has {family.source_keys.get(key, key)}={value}")
    if mismatches:
        raise ConfigError(f"model.hf_checkpoint {cfg.model.hf_checkpoint}: {'; '.join(mismatches)} (drop those "
                          f"settings: the checkpoint's config.json fixes the model)")
    if (note := tied_head(cfg, family, typed)) is not None and notes is not None:
        notes.append(note)
    if positions is None:
        return None
    if "model.sequence_length" not in typed:
        cfg.model.sequence_length = min(cfg.model.sequence_length, positions)
    if cfg.model.sequence_length > positions:
        raise ConfigError(f"model.sequence_length: {cfg.model.sequence_length} exceeds the checkpoint's "
                          f"{family.positions_key}={positions}")
    return family.positions_key, positions


def tied_head(cfg: DictConfig, family: ModelFamily, typed: set[str]) -> str | None:
    """``tie_word_embeddings: true`` whose weights also hold the head's own tensor (``lm_head.weight``: the name
    an untied model of the family has and a tied one lacks), read as transformers 5 reads that directory: a
    head of another shape than the embeddings' table is refused (transformers raises on it); one equal to the
    table is the tied head; one that differs is the head, untied (transformers warns and does not tie them),
    and the note that says so is returned. Unless the user typed ``model.tie_embeddings`` themselves."""
    if not cfg.model.tie_embeddings or "model.tie_embeddings" in typed:
        return None
    untied, outer = cfg.copy(), cfg.copy()
    untied.model.tie_embeddings = False
    outer.model.layers = 0  # the names outside the layers: where the embeddings' table is
    heads = sorted(family.parameter_names(untied) - family.parameter_names(cfg))
    weights = HFWeights(cfg.model.hf_checkpoint)
    present = [name for name in heads if name in weights]
    if not present:
        return None
    source = f"model.hf_checkpoint {weights.directory}"
    table = (cfg.model.embedding.vocab_size, cfg.model.hidden_size)
    for name in present:
        if (shape := weights.shape(name)) != table:
            raise CheckpointError(f"{source}: config.json ties the head to the embeddings (tie_word_embeddings: "
                                  f"true), but its weights hold {name} of shape {shape}, not the table's {table}; "
                                  f"transformers refuses it too: remove {name} or give it shape {table}")
    tables = [n for n in sorted(family.parameter_names(outer) - set(heads)) if n in weights
              and weights.shape(n) == table]
    if len(tables) != 1:
        raise CheckpointError(f"{source}: config.json ties the head to the embeddings, its weights hold "
                              f"{present[0]} too, and which tensor is the embeddings' table is unclear "
                              f"({', '.join(tables) or 'none'}); remove {present[0]}")
    embedding = weights.get(tables[0])
    if all(torch.equal(weights.get(name), embedding) for name in present):
        return None
    cfg.model.tie_embeddings = False
    return (f"note: {source}: config.json ties the head to the embeddings (tie_word_embeddings: true) but its "
            f"{present[0]} differs from {tables[0]}: the head is {present[0]}, untied, as transformers loads it")


_INDEX_LIMIT = 1 << 26  # bytes; GPT-J-6B's index is about 30 kB


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: tensor name → the file (in the same directory) that
    holds it. The index is untrusted: anything but a JSON object mapping names to plain file names is one
    line naming the index."""
    data = _read_json(index, _INDEX_LIMIT)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = type(weight_map).__name__ if isinstance(data, dict) and "weight_map" in data else "none"
        raise CheckpointError(f"{index}: weight_map must be a JSON object of tensor names to file names, found {found}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise CheckpointError(f"{index}: weight_map[{name[:80]!r}] must name a file in the checkpoint's directory, "
                                  f"got {str(file)[:80]!r}")
    return weight_map


class HFWeights:
    """Read a Hugging Face checkpoint's tensors one at a time, by name.

    Every weight file is opened (its header only: safetensors maps, ``.bin`` files are memory-mapped) when the
    reader is made, each checked first to be a regular file, and an index is checked against them: a tensor it
    puts in a file that does not hold it is one line naming both, before anything is computed or written."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._open: dict[Path, object] = {}
        self._held: dict[Path, dict[str, None]] = {}  # each file's tensor names, in its order
        self.index: Path | None = None
        self.files = self._weight_map()
        for file in dict.fromkeys(self.files.values()):
            held = self._names(file)
            missing = [name for name, f in self.files.items() if f == file and name not in held]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise CheckpointError(f"{self.index}: weight_map puts {missing[0][:80]}{more} in {file.name}, which "
                                      f"does not hold it; the index does not match its weight files")

    def _weight_map(self) -> dict[str, Path]:
        d = self.directory
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = d / index_name
            if index.exists():
                self.index = index
                return {name: d / file for name, file in _weight_map(index).items()}
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (d / single).exists():
                return {name: d / single for name in self._names(d / single)}
        raise CheckpointError(f"model.hf_checkpoint: {d} holds no model.safetensors, pytorch_model.bin or index")

    def _names(self, file: Path) -> dict[str, None]:
        if file not in self._held:
            self._held[file] = dict.fromkeys(self._handle(file).keys())
        return self._held[file]

    def _handle(self, file: Path):
        if file not in self._open:
            if not file.exists():
                raise CheckpointError(f"{file} is listed in the weight index but does not exist")
            require_regular(file, str(file))  # a FIFO would block the open, a device map garbage
            try:
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    self._open[file] = safe_open(str(file), framework="pt", device="cpu")
                else:  # never unpickle arbitrary objects; memory-map so the file is not read whole
                    self._open[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 (a truncated or corrupted file: one line, naming it)
                raise CheckpointError(f"{file} cannot be read: {type(exc).__name__}: {exc}") from None
            if not hasattr(self._open[file], "keys"):
                raise CheckpointError(f"{file} cannot be read: it holds a {type(self._open[file]).__name__}, not "
                                      f"a mapping of tensor names to tensors")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, from its file's header (nothing read)."""
        handle = self._handle(self.files[name])
        return tuple(handle.get_slice(name).get_shape() if hasattr(handle, "get_slice") else handle[name].shape)

    def get(self, name: str) -> torch.Tensor:
        handle = self._handle(self.files[name])
        return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def layers(self, modules) -> tuple[int, str] | None:
        """The highest decoder layer these weights hold, as the decoder component names its tensors
        (``modules["decoder"].hf_mapping``), and one tensor of it; None if they hold none."""
        sentinel = "1000000007"  # a layer index no name holds otherwise: where a name carries its layer
        decoder = modules["decoder"]
        fused = decoder.hf_fused(int(sentinel)) if isinstance(decoder, HasFusedTensors) else ()
        patterns = {re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
                    for hf in [*decoder.hf_mapping(int(sentinel)).values(), *(f.name for f in fused)]
                    if sentinel in hf for before, _, after in [hf.partition(sentinel)]}
        found = [(int(m.group(1)), name) for name in self.files for p in patterns if (m := p.fullmatch(name))]
        return max(found) if found else None


def hf_initializer(directory: str | Path, modules, layers: int,
                   added: Callable[[str, list[VariableSpec]], dict]) -> Callable[[str, list[VariableSpec]], dict]:
    """An engine initializer that fills each unit from the checkpoint, tensor by tensor. A variable the
    component marks ``added`` (an adapter: it has no Hugging Face name) starts from ``added(unit, [spec])``,
    the run's random start (:func:`ipuft.engine.variables.initial_values`); any other variable without a name
    stops the import."""
    weights = HFWeights(directory)
    mappings = unit_mappings(modules, layers)
    source = f"model.hf_checkpoint {weights.directory}"
    highest = weights.layers(modules)
    if highest is not None and highest[0] >= layers:
        raise CheckpointError(f"{source}: its weights hold layer {highest[0]} ({highest[1][:80]}), but its "
                              f"config.json names {layers} layers; config.json must describe all the weights "
                              f"(their first {layers} layers alone are another model)")

    fused = unit_fused(modules, layers)

    def initial(unit: str, specs: list[VariableSpec]) -> dict[str, torch.Tensor]:
        hf_names = mappings[unit]
        parts = split_parts(unit, specs)
        available = parts.keys() | weights.files.keys()
        out = {}
        for spec in specs:
            if spec.name in hf_names:
                out[spec.name] = checked(spec, hf_names[spec.name], available,
                                         lambda n: parts[n] if n in parts else weights.get(n), source)
            elif spec.added:
                out.update(added(unit, [spec]))
            else:
                raise PluginError(f"{source}: {unit}.{spec.name} has no Hugging Face name (the component's "
                                  f"hf_mapping) and is not marked added, so it cannot start from this checkpoint")
        return out

    def split_parts(unit: str, specs: list[VariableSpec]) -> dict[str, torch.Tensor]:
        """The unit's variables that the checkpoint holds stacked in one tensor, by Hugging Face name."""
        shapes = {mappings[unit][s.name]: s.shape for s in specs if s.name in mappings[unit]}
        parts: dict[str, torch.Tensor] = {}
        for tensor in fused[unit]:
            if lacking := [p for p in tensor.parts if p not in shapes]:
                raise PluginError(f"{source}: {unit}'s component stacks {lacking[0]} into {tensor.name} "
                                  f"(hf_fused), but none of its variables has that name (hf_mapping)")
            if tensor.name not in weights:
                raise CheckpointError(f"{source} lacks {tensor.name}: it is of another model")
            parts.update(split_rows(tensor, weights.get(tensor.name), shapes, source))
        return parts

    return initial
