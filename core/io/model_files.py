"""The small files that travel with a model (:data:`~ipuft.io.checkpoint.MODEL_FILES`): its tokenizer's
(tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja) and its source's
(config.json, kept as ``hf_config.json``, and generation_config.json).

A run reads them once, where its model and tokenizer come from (a Hugging Face directory, a tokenizer's
directory, or an ipuft checkpoint), its checkpoints carry them, and an export writes them back: so
``AutoTokenizer`` and ``AutoConfig`` on an export give the source's special tokens, chat template and
positions, and a run started from a run's checkpoint has them too.

Every one is untrusted data: a regular file of bounded size (a link is followed only within its directory,
or from a hub cache snapshot into that repository's blobs), the JSON ones parsed as JSON objects, the chat
template decoded as UTF-8 text. Nothing in them is taken as a path, resolved or rendered; they are copied
as bytes once checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import MODEL_FILES, SOURCE_CONFIG, find_checkpoint, read_manifest, read_verified
from ipuft.io.files import read_bounded

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Bytes each may take: a tokenizer.json is a few MB (up to tens for large vocabularies), a tokenizer_config.json
# listing many added tokens up to a few MB, the rest a few kB.
LIMITS = {"tokenizer.json": 1 << 30, "tokenizer_config.json": 1 << 24}
SMALL_LIMIT = 1 << 20


def limit(name: str) -> int:
    """The most bytes file ``name`` of :data:`MODEL_FILES` may take."""
    return LIMITS.get(name, SMALL_LIMIT)


def on_disk(name: str) -> str:
    """The name file ``name`` has in a Hugging Face directory (the source config is its config.json)."""
    return "config.json" if name == SOURCE_CONFIG else name


def checked(name: str, data: bytes, where: str) -> bytes:
    """``data``, once it is what file ``name`` must be: a JSON object for the ``.json`` files, UTF-8 text for the
    chat template; one line naming ``where`` (the file) otherwise."""
    if len(data) > limit(name):
        raise CheckpointError(f"{where} is larger than {limit(name)} bytes: not a model's {on_disk(name)}")
    try:
        text = data.decode("utf-8")
        if name.endswith(".json"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise CheckpointError(f"{where} must be a JSON object, not {type(value).__name__}")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    return data


def _roots(directory: Path) -> list[Path]:
    """Where a file of ``directory`` may really be: the directory itself, and for a Hugging Face hub cache
    snapshot (``models--org--name/snapshots/<commit>``) that repository's ``blobs``, which its links point into."""
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def read_directory_file(directory: Path, name: str, where: str, file: str | None = None) -> bytes | None:
    """File ``name`` of :data:`MODEL_FILES` from ``directory`` (as ``file``, by default its :func:`on_disk` name),
    checked; None if absent.

    A link that leads out of the directory (or, in a hub cache snapshot, out of its repository's blobs), anything
    but a regular file, or a file over its size limit is one line naming it (after ``where``, the config key)."""
    path = directory / (file or on_disk(name))
    if not path.is_symlink() and not path.exists():
        return None
    target = path.resolve()
    if not any(target.is_relative_to(root) for root in _roots(directory)):
        raise CheckpointError(f"{where}{path} is a link out of its directory; copy the file itself there")
    if not target.exists():
        raise CheckpointError(f"{where}{path} is a dangling link")
    data = read_bounded(target, limit(name), f"{where}{path}", hint=f": not a model's {path.name}")
    return checked(name, data, f"{where}{path}")


def checkpoint_files(checkpoint: Path, names: tuple[str, ...] = MODEL_FILES) -> dict[str, bytes]:
    """Those of ``names`` that ipuft checkpoint ``checkpoint`` holds, each verified against its manifest and checked."""
    manifest = read_manifest(checkpoint)
    return {name: checked(name, read_verified(checkpoint, name, limit(name)), f"{checkpoint / name}")
            for name in names if name in manifest}


def home_files(home: Path, names: tuple[str, ...], where: str) -> dict[str, bytes]:
    """Those of ``names`` that ``home`` holds: an ipuft checkpoint (verified), else a directory."""
    if (home / "meta.json").exists() and (home / "manifest.json").exists():
        return checkpoint_files(home, names)
    return {name: data for name in names if (data := read_directory_file(home, name, where)) is not None}


def model_home(cfg: DictConfig) -> tuple[Path, str] | None:
    """Where the run's model comes from, and the config key that says so: ``model.hf_checkpoint`` (a
    directory), else ``model.init_checkpoint`` or ``checkpoint.load`` (an ipuft checkpoint); None for a model
    from scratch."""
    if cfg.model.get("hf_checkpoint") is not None:
        return Path(cfg.model.hf_checkpoint), "model.hf_checkpoint"
    for key, value in (("model.init_checkpoint", cfg.model.get("init_checkpoint")),
                       ("checkpoint.load", cfg.checkpoint.get("load"))):
        if value is not None:
            return find_checkpoint(value), key
    return None
