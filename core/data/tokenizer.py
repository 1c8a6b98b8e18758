"""The run's tokenizer: ``data.tokenizer`` (the shipped sample, a directory holding ``tokenizer.json``, or the
file), else the checkpoint's. Loaded by the ``tokenizers`` library; nothing reaches the network."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ipuft.errors import DataError, first_line

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from tokenizers import Tokenizer

SAMPLE_TOKENIZER = "sample"
EOS = "<|endoftext|>"  # GPT-J's end-of-text token


def tokenizer_path(spec: str) -> Path:
    """Where the tokenizer.json named by ``spec`` is: ``"sample"`` (shipped with ipuft), a directory
    holding it, or the file itself (which may not exist)."""
    if spec == SAMPLE_TOKENIZER:
        return Path(str(resources.files("ipuft.sample_data") / "tokenizer.json"))
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_source(cfg: DictConfig) -> tuple[str, str] | None:
    """The run's tokenizer: ``(spec, config key)`` of ``data.tokenizer``, else of ``model.hf_checkpoint``
    (its directory holds tokenizer.json); ``None`` when neither is set."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer, "data.tokenizer"
    if cfg.model.get("hf_checkpoint") is not None:
        return cfg.model.hf_checkpoint, "model.hf_checkpoint"
    if cfg.model.get("init_checkpoint") is not None:
        from ipuft.io.checkpoint import find_checkpoint

        return str(find_checkpoint(cfg.model.init_checkpoint)), "model.init_checkpoint"
    return None


TOKENIZER_LIMIT = 1 << 30  # bytes a checkpoint's tokenizer.json may take; real ones are a few MB


def tokenizer_from_bytes(data: bytes, path: Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from the bytes of ``path`` (a checkpoint's tokenizer.json, read and verified
    by the caller); one line naming ``path`` if they are not a tokenizer."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 (a bad encoding, or the Rust side's plain Exceptions)
        why = first_line(exc, type(exc).__name__)[:200]
        raise DataError(f"{path} is not a valid tokenizer.json ({why})") from None


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from ``"sample"`` (shipped with ipuft), a directory holding
    ``tokenizer.json``, or the file itself. ``key`` names the config key in error messages."""
    from tokenizers import Tokenizer

    path = tokenizer_path(spec)
    if not path.is_file():
        raise DataError(f"{key}: no tokenizer.json at {path}; give a directory holding tokenizer.json "
                        f"or the file itself")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 (the Rust side raises plain Exceptions)
        why = first_line(exc, type(exc).__name__)
        raise DataError(f"{key}: {path} is not a valid tokenizer.json ({why})") from None
