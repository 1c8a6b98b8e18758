"""``ipuft export``: a checkpoint opened, its model built, and written as a Hugging Face directory
(:func:`export_hf`, :mod:`ipuft.io.hf_export`) or as a peft adapter (:func:`export_adapter`,
:mod:`ipuft.io.hf_adapter`). Both check the target before any work (and again when they write), and read, so
verify, the checkpoint's manifest, meta.json and config before its weights."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ipuft.config import checkpoint_config
from ipuft.engine.model import build_model
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import find_checkpoint, read_manifest, read_meta
from ipuft.io.export_dir import check_export_target
from ipuft.io.hf_adapter import is_adapter_export, write_adapter
from ipuft.io.hf_export import write_hf
from ipuft.io.hf_names import DEFAULT_SHARD_BYTES
from ipuft.plugins import PluginHooks


def _opened(path: str | Path, out: str | Path, flag: str, hooks: PluginHooks,
            *replaceable) -> tuple[Path, dict, DictConfig]:
    """The checkpoint ``path`` names (or a run directory's latest), its manifest and its config, after checking
    that ``out`` may be written (``replaceable``: what an earlier export there looks like)."""
    checkpoint = find_checkpoint(path)
    check_export_target(out, flag, [checkpoint], *replaceable)
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
