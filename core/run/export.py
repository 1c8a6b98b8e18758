"""``ipuft export``: a checkpoint opened, its model built, and written as a Hugging Face directory
(:func:`export_hf`, :mod:`ipuft.io.hf_export`), as a peft adapter (:func:`export_adapter`,
:mod:`ipuft.io.hf_adapter`) or as a GGUF file (:func:`export_gguf`, :mod:`ipuft.io.gguf_export`). Each checks the
target before any work (and again when it writes), and reads, so verifies, the checkpoint's manifest, meta.json
and config before its weights."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ipuft.config import checkpoint_config
from ipuft.engine.model import build_model
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import find_checkpoint, read_manifest, read_meta
from ipuft.io.export_dir import check_export_target, staged_file
from ipuft.io.hf_adapter import is_adapter_export, write_adapter
from ipuft.io.hf_export import write_hf
from ipuft.io.hf_names import DEFAULT_SHARD_BYTES
from ipuft.io.model_files import checkpoint_files
from ipuft.plugins import PluginHooks


def _opened(path: str | Path, out: str | Path, flag: str, hooks: PluginHooks,
            *replaceable, file: bool = False) -> tuple[Path, dict, DictConfig]:
    """The checkpoint ``path`` names (or a run directory's latest), its manifest and its config, after checking
    that ``out`` may be written (``replaceable``: what an earlier export there looks like; ``file``: ``out`` is
    a file)."""
    checkpoint = find_checkpoint(path)
    check_export_target(out, flag, [checkpoint], *replaceable, file=file)
    manifest = read_manifest(checkpoint)
    read_meta(checkpoint)
    return checkpoint, manifest, checkpoint_config(checkpoint, hooks.registrations.config_sections)


def export_hf(path: str | Path, out: str | Path, hooks: PluginHooks, shard_bytes: int = DEFAULT_SHARD_BYTES,
              dtype: str | None = None) -> Path:
    """Write checkpoint ``path`` (or a run directory's latest) as a Hugging Face directory ``out``, its weights
    in ``dtype`` (``float32``, ``bfloat16`` or ``float16``; by default the precision the run trained in)."""
    checkpoint, manifest, cfg = _opened(path, out, "--hf", hooks)
    parts = build_model(cfg, hooks)
    family = hooks.registrations.families.get(cfg.model.family)
    return write_hf(checkpoint, manifest, cfg, parts, family, out, shard_bytes, dtype or cfg.model.precision.value)


def export_adapter(path: str | Path, out: str | Path, hooks: PluginHooks, dtype: str | None = None) -> Path:
    """Write the adapters of checkpoint ``path`` (or a run directory's latest) as a peft adapter directory
    ``out``, in ``dtype`` (by default the precision the run trained in)."""
    checkpoint, manifest, cfg = _opened(path, out, "--adapter", hooks, is_adapter_export)
    if cfg.model.adapter is None:
        raise CheckpointError(f"--adapter: checkpoint {checkpoint} has no adapter (its model.adapter is null): "
                              f"export the whole model with --hf")
    parts = build_model(cfg, hooks)
    return write_adapter(checkpoint, manifest, cfg, parts, out, dtype or cfg.model.precision.value)


def export_gguf(path: str | Path, out: str | Path, hooks: PluginHooks, gguf_type: str = "f16") -> Path:
    """Write checkpoint ``path`` (or a run directory's latest) as GGUF file ``out``, its matrices in
    ``gguf_type`` (``f32``, ``f16``, ``bf16`` or ``q8_0``), replacing an earlier GGUF file there.

    The family, its settings and the tokenizer are checked first, so that a checkpoint GGUF cannot carry is one
    line before any work. Then the model is exported as a Hugging Face directory (LoRA merged; float32 for
    ``f32``, else in the precision trained in) into a scratch directory beside ``out``, converted there
    (:func:`ipuft.io.gguf_export.write_gguf`) and renamed into place; the scratch directory goes whatever
    happens."""
    from ipuft.io.gguf_export import check_model, gguf_library, is_gguf_file, write_gguf
    from ipuft.io.gguf_tokenizer import read_vocab

    gguf_library()
    checkpoint, manifest, cfg = _opened(path, out, "--gguf", hooks, is_gguf_file, file=True)
    family = hooks.registrations.families.get(cfg.model.family)
    settings = {key: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
                for key in family.model_keys if (value := OmegaConf.select(cfg, key, default=None)) is not None}
    check_model(family.model_type, settings)
    tokenizer = checkpoint_files(checkpoint, ("tokenizer.json",)).get("tokenizer.json")
    if tokenizer is None:
        raise CheckpointError(f"--gguf: checkpoint {checkpoint} has no tokenizer.json, and a GGUF file carries "
                              f"its tokenizer")
    read_vocab(tokenizer.decode("utf-8", "replace"), cfg.model.embedding.vocab_size)
    parts = build_model(cfg, hooks)
    dtype = "float32" if gguf_type == "f32" else cfg.model.precision.value
    target = Path(out).resolve()
    with staged_file(Path(out), "--gguf", [checkpoint], is_gguf_file) as tmp:
        hf = write_hf(checkpoint, manifest, cfg, parts, family, tmp / ".hf-export", dtype=dtype, option="--gguf")
        write_gguf(hf, tmp / target.name, gguf_type, family, target.stem)
    return Path(out)
