"""``ipuft export``: an ipuft checkpoint as a Hugging Face directory of its ``model.family`` (config.json,
safetensors weights with an index when they exceed one shard, the tokenizer's files and
generation_config.json), which transformers loads (``GPTJForCausalLM``, ``LlamaForCausalLM``, ...).

config.json is the source's, written back as it was read, where the model came from a Hugging Face checkpoint
(:func:`hf_config`), and the tokenizer's files are the source's too (:mod:`ipuft.io.model_files`), so
``AutoTokenizer`` and ``AutoConfig`` on the export give the source's special tokens, chat template and positions.

It streams: each tensor is read from the checkpoint's model.safetensors (verified as it is read) and
written into its shard before the next is read, so export needs about one tensor of memory; a tensor that a
component's ``hf_fused`` stacks (Phi-3's ``qkv_proj``) is stacked from its parts as it is written. It reads, and
so verifies, only model.safetensors, config.yaml, meta.json and the model's own files: a damaged optimizer
state does not stop an export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ipuft.components import Merges, VariableSpec
from ipuft.data.tokenizer import EOS, tokenizer_from_bytes
from ipuft.errors import CheckpointError, PluginError, described
from ipuft.families import HFConfigError, ModelFamily, check_config_fields
from ipuft.io.checkpoint import (
    SOURCE_CONFIG,
    WEIGHTS,
    open_tensors,
)
from ipuft.io.export_dir import staged_directory
from ipuft.io.hf_names import (
    DEFAULT_SHARD_BYTES,
    component_hf_config,
    export_names,
    stack_rows,
    unit_fused,
    unit_mappings,
)
from ipuft.io.model_files import checkpoint_files
from ipuft.precision import DTYPES

# config.json keys the run decides whatever its source said, besides the weights' dtype: as the family's
# write_config gives it for the model the run built, whether the head is tied to the embeddings.
RUN_KEYS = ("tie_word_embeddings",)
# Source keys an export drops: auto_map names code files, which ipuft never copies.
DROPPED = ("auto_map",)


def _agrees(current, value) -> bool:
    """Whether the run's value of a key is the one the source's config.json gives (an object: every key it gives)."""
    if isinstance(value, dict) and isinstance(current, dict):
        return all(k in current and _agrees(current[k], v) for k, v in value.items())
    return current == value


def source_mismatches(cfg: DictConfig, family: ModelFamily, source: dict) -> list[str]:
    """Where the source's config.json (as the family reads it) says otherwise than the run's config: a
    config.json that no longer describes the model cannot be written back as it was read."""
    try:
        check_config_fields(source)  # what is written back unread must be valid too
    except HFConfigError as exc:
        return [str(exc)]
    try:
        settings = family.read_config(source)
    except HFConfigError as exc:
        return [f"the family reads it as: {exc}"]
    except Exception as exc:  # noqa: BLE001 (the family plugin's bug on odd input: one line naming it)
        raise PluginError(f"model family {family.model_type!r} of plugin {family.plugin!r} failed to read the "
                          f"source's config.json: {described(exc)}") from None
    found = []
    for key, value in settings.items():
        if family.source_keys.get(key) in RUN_KEYS:  # the run decides it (a tied source read untied, say)
            continue
        current = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(current):
            current = OmegaConf.to_container(current)
        if not _agrees(current, value):
            found.append(f"{family.source_keys.get(key, key)}={str(value)[:40]} but {key}={str(current)[:40]}")
    return found


def hf_config(cfg: DictConfig, family: ModelFamily, eos_id: int | None, dtype: str = "float32",
              components: dict | None = None, source: dict | None = None) -> dict:
    """A transformers config, as JSON, for the run's model.

    With ``source``, the config.json the model came from (kept in its checkpoints as hf_config.json), every
    field is written back as it was read (positions, rope, ids, window, norms, and fields ipuft does not read),
    after checking that the family reads it as the run's model (:func:`source_mismatches`); only what the run
    decides changes: ``architectures`` and ``model_type`` (the family's), what the components contribute, the
    weights' ``dtype``, :data:`RUN_KEYS`, and the special tokens where the run set its own.

    Without one (a model from scratch), the family's keys (:attr:`ModelFamily.write_config`: the shapes import
    reads back, the architecture's fixed settings), what the components contribute
    (:func:`ipuft.io.hf_names.component_hf_config`: GPT-J's ``activation_function``), the special tokens
    (``model.bos_token_id`` and ``model.eos_token_ids`` where the model came with them, else ``eos_id``, the
    tokenizer's <|endoftext|>, for both) and the weights' ``dtype``."""
    try:
        written = family.write_config(cfg)
    except HFConfigError as exc:
        raise CheckpointError(f"model.family={family.model_type}: {exc}") from None
    own = {"architectures": [family.architecture], "model_type": family.model_type}
    eos = list(cfg.model.eos_token_ids)
    if source is not None:
        if mismatches := source_mismatches(cfg, family, source):
            raise CheckpointError(f"model.family={family.model_type}: the source's config.json (hf_config.json) does "
                                  f"not describe the model: {'; '.join(mismatches[:4])}")
        config = {**{k: v for k, v in source.items() if k not in DROPPED}, **own, **(components or {}),
                  **{k: written[k] for k in RUN_KEYS if k in written}}
        for key in [k for k in ("torch_dtype", "dtype") if k in source] or ["torch_dtype"]:
            config[key] = dtype  # transformers 5 writes dtype, earlier versions torch_dtype
        if cfg.model.bos_token_id is not None:
            config["bos_token_id"] = cfg.model.bos_token_id
        if eos:
            config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return config
    config = {**own, **written, **(components or {}), "torch_dtype": dtype}
    eos = eos or ([] if eos_id is None else [eos_id])
    bos = cfg.model.bos_token_id if cfg.model.bos_token_id is not None else eos_id
    if bos is not None:
        config["bos_token_id"] = bos
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def write_hf(checkpoint: Path, manifest: dict, cfg: DictConfig, parts, family: ModelFamily, out: str | Path,
             shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str = "float32", option: str = "--hf") -> Path:
    """Write ``checkpoint`` (its verified ``manifest``, its config ``cfg`` and the model ``parts`` built from it,
    of ``family``) as a Hugging Face directory ``out``, its weights in ``dtype`` (``float32``, ``bfloat16`` or
    ``float16``); ``option`` names the export in messages. :func:`ipuft.run.export.export_hf` opens the
    checkpoint and builds the model."""
    from ipuft.io.safetensors import SafetensorsWriter

    torch_dtype = DTYPES[dtype]
    # Checked before anything is written: every variable has a name (or is merged), no name twice, a complete
    # model of the family.
    names = export_names(parts.modules, parts.variables, cfg, family)
    components = component_hf_config(parts.modules, family)
    # The model's own files (verified as they are read): the source's config.json, written back, and the
    # tokenizer's files, copied; without a source, the tokenizer gives config.json's special tokens where the
    # model has none of its own. The config is complete before anything is written.
    files = checkpoint_files(checkpoint)
    eos_id = None
    if "tokenizer.json" in files:
        eos_id = tokenizer_from_bytes(files["tokenizer.json"], checkpoint / "tokenizer.json").token_to_id(EOS)
        if eos_id is not None and eos_id >= cfg.model.embedding.vocab_size:
            eos_id = None  # no token of the model: never written as its bos or eos
    source = json.loads(files[SOURCE_CONFIG]) if SOURCE_CONFIG in files else None
    config = hf_config(cfg, family, eos_id, dtype, components, source)
    units = list(unit_mappings(parts.modules, cfg.model.layers))
    merging = {unit for unit in units if isinstance(parts.modules[unit.role], Merges)}
    shapes = {f"{unit}.{v.name}": tuple(v.shape) for unit in units for v in parts.variables[unit.role]}
    reader = open_tensors(checkpoint, WEIGHTS, manifest)
    needed = set(names) | {f"{u}.{v.name}" for u in merging for v in parts.variables[u.role]}
    missing = sorted(needed - set(reader.keys()))
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint} lacks {', '.join(missing[:5])}")
    for name in needed:
        if name in shapes and reader.entries[name].shape != shapes[name]:
            raise CheckpointError(f"checkpoint {checkpoint}: {name} has shape {reader.entries[name].shape}, the "
                                  f"model expects {shapes[name]}")

    # Each tensor the files hold, from the variables it is written from: one, or the parts a fused tensor stacks
    # (hf_fused), in row order.
    outputs = written_tensors(names, unit_fused(parts.modules, cfg.model.layers), reader.entries)
    # Plan the shards from the header, in the file's order (so that reading is one pass), then write them one
    # tensor at a time: never more than a tensor (a fused one and its parts) in memory.
    shards: list[list[VariableSpec]] = [[]]
    size = total = 0
    for hf_name in sorted(outputs, key=lambda n: reader.entries[outputs[n][1][0]].begin):
        spec = VariableSpec(hf_name, outputs[hf_name][2], torch_dtype)
        nbytes = math.prod(spec.shape) * torch_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
        total += nbytes
    with staged_directory(Path(out), option, [checkpoint]) as tmp:
        weight_map = {}
        merged: dict[str, object] = {}  # a merging unit's exported tensors, read and merged together

        def exported(name: str):
            unit = next((u for u in merging if name.startswith(f"{u}.")), None)
            if unit is None:
                return reader.get(name)
            if name not in merged:
                role = unit.role
                tensors = {v.name: reader.get(f"{unit}.{v.name}") for v in parts.variables[role]}
                merged.update({f"{unit}.{n}": t for n, t in parts.modules[role].hf_merge(tensors).items()})
            return merged.pop(name)

        for i, shard in enumerate(shards, start=1):
            file = WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            with SafetensorsWriter(tmp / file, shard, {"format": "pt"}) as writer:
                for spec in shard:
                    fused, sources, _ = outputs[spec.name]
                    if fused is None:
                        tensor = exported(sources[0])
                    else:
                        tensor = stack_rows(fused, {names[n]: exported(n) for n in sources})
                    writer.write(spec.name, tensor.to(torch_dtype))
                writer.close()
            weight_map.update({s.name: file for s in shard})
        reader.finish()  # raises if the weights read were not the checkpoint's: nothing is left behind
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        for name, data in files.items():
            if name != SOURCE_CONFIG:  # the tokenizer's files and generation_config.json, as the source had them
                (tmp / name).write_bytes(data)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return Path(out)


def written_tensors(names: dict[str, str], fused: dict, entries: dict) -> dict[str, tuple]:
    """``{hf_name: (fused, sources, shape)}`` of every tensor an export writes: ``fused`` the
    :class:`~ipuft.components.FusedRows` it stacks (None for a plain one), ``sources`` the ``"<unit>.<variable>"``
    names it is written from (its parts in row order), ``shape`` its shape (from the checkpoint's ``entries``)."""
    by_hf = {hf: name for name, hf in names.items()}
    stacked = {p: f for group in fused.values() for f in group for p in f.parts}
    out: dict[str, tuple] = {}
    for name, hf in names.items():
        if hf not in stacked:
            out[hf] = (None, [name], tuple(entries[name].shape))
        elif (f := stacked[hf]).name not in out:
            sources = [by_hf[p] for p in f.parts]
            shapes = [tuple(entries[n].shape) for n in sources]
            out[f.name] = (f, sources, (sum(s[0] for s in shapes), *shapes[0][1:]))
    return out
