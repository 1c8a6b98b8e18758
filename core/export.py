"""``ipuft export``: an ipuft checkpoint as a Hugging Face GPT-J directory (config.json, safetensors
weights with an index when they exceed one shard), which transformers' ``GPTJForCausalLM`` loads."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft.checkpoint import WEIGHTS, checkpoint_config, find_checkpoint, read_meta, verify
from ipuft.datasets import EOS, load_tokenizer
from ipuft.errors import CheckpointError
from ipuft.hf import DEFAULT_SHARD_BYTES, unit_mappings
from ipuft.hf_checkpoint import HF_SHAPES
from ipuft.model import build_model
from ipuft.plugins import PluginHooks
from ipuft.precision import DTYPES


def hf_config(cfg: DictConfig, eos_id: int | None, dtype: str = "float32") -> dict:
    """A transformers GPTJConfig, as JSON, for the run's model: the shapes import reads back
    (:data:`~ipuft.hf_checkpoint.HF_SHAPES`), GPT-J's fixed settings, and the weights' ``dtype``."""
    config = {
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj",
        **{hf: OmegaConf.select(cfg, key) for hf, key in HF_SHAPES.items()},
        "n_positions": max(cfg.model.sequence_length, 2048), "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if eos_id is not None:
        config.update(bos_token_id=eos_id, eos_token_id=eos_id)
    return config


def _eos_id(tokenizer: Path) -> int | None:
    return load_tokenizer(str(tokenizer)).token_to_id(EOS) if tokenizer.exists() else None


def export_hf(path: str | Path, out: str | Path, hooks: PluginHooks, shard_bytes: int = DEFAULT_SHARD_BYTES,
              dtype: str | None = None) -> Path:
    """Write checkpoint ``path`` (or a run directory's latest) as a Hugging Face directory ``out``, its weights
    in ``dtype`` (``float32``, ``bfloat16`` or ``float16``; by default the precision the run trained in)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint = find_checkpoint(path)
    verify(checkpoint)
    read_meta(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--hf {out} exists and is not an empty directory; choose a new directory")
    cfg = checkpoint_config(checkpoint, hooks.registrations.config_sections)
    dtype = dtype or cfg.model.precision.value
    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    parts = build_model(cfg, hooks)
    names = {f"{unit}.{local}": hf for unit, m in unit_mappings(parts.modules, cfg.model.layers).items()
             for local, hf in m.items()}
    handle = safe_open(str(checkpoint / WEIGHTS), framework="pt", device="cpu")
    missing = sorted(set(names) - set(handle.keys()))
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint} lacks {', '.join(missing[:5])}")

    # Plan the shards from the tensors' sizes, then write them one by one: never the whole model in memory.
    shards: list[list[str]] = [[]]
    size = total = 0
    for name in names:
        meta = handle.get_slice(name)
        nbytes = math.prod(meta.get_shape()) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    # Written into a temporary directory beside ``out`` and renamed into place, as checkpoints are: a full
    # disk, a read-only place or a kill leaves no partial export under the final name.
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise CheckpointError(f"--hf {out} cannot be written ({exc.strerror or exc})") from None
    try:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({names[n]: handle.get_tensor(n).to(torch_dtype).contiguous() for n in shard}, str(tmp / file),
                      metadata={"format": "pt"})
            weight_map.update({names[n]: file for n in shard})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        tokenizer = checkpoint / "tokenizer.json"
        if tokenizer.exists():
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, _eos_id(tokenizer), dtype), indent=2))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for the scratch directory, not the export
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except Exception as exc:  # noqa: BLE001 (a full disk is an OSError, or safetensors' own error)
        why = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
        raise CheckpointError(f"--hf {out} cannot be written ({why}); nothing was left behind") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

