"""``ipuft eval``: the mean token loss and perplexity over ``data.path``, and MNLI accuracy by generation.

The loss pass runs the phased engine forward-only, layer-major, so it works for models larger than the
device like training does. MNLI accuracy generates the label after ``target:`` greedily, as the
reference's validation did: a prediction that matches no label counts as wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from ipuft.checkpoint import checkpoint_config, read_verified
from ipuft.config import load_config
from ipuft.datasets import (
    EOS,
    TokenDataset,
    data_source,
    load_tokenizer,
    read_rows,
    resolve_data_path,
    tokenizer_source,
)
from ipuft.engine import unit_role
from ipuft.errors import DataError
from ipuft.generate import generate
from ipuft.model import ModelParts, build_model
from ipuft.plugins import PluginHooks
from ipuft.templates import resolve_template
from ipuft.train import build_engine, collective_errors, dataset_loss, initializer, select_device


def evaluate_loss(cfg: DictConfig, hooks: PluginHooks, dataset: TokenDataset | None = None) -> dict:
    """``{"loss", "perplexity", "tokens"}`` over every row of ``data.path`` (or of ``dataset``), once, in order."""
    if dataset is None and cfg.data.path is None:
        raise DataError("data.path: eval needs a dataset; set data.path=FILE")
    dataset = dataset if dataset is not None else data_source(cfg)
    assert isinstance(dataset, TokenDataset)
    engine = build_engine(cfg, hooks)
    with collective_errors(engine.layout):
        return dataset_loss(engine, dataset, cfg.execution.micro_batch_size)


def inference_config(path: str, hooks: PluginHooks, overrides: tuple[str, ...] | list[str] = ()) -> DictConfig:
    """The config of a model to run in one process: an ipuft checkpoint's (or a run directory's latest),
    or a Hugging Face directory's shapes; then ``overrides`` (``KEY=VALUE``)."""
    sections = hooks.registrations.config_sections
    single = ["execution.data_parallel=1", "execution.tensor_parallel=1", "training.global_batch_size=1",
              "execution.micro_batch_size=1"]
    if (Path(path) / "config.json").exists():
        return load_config(None, [f"model.hf_checkpoint={path}", *single, *overrides], sections)
    return checkpoint_config(path, sections, [*single, *overrides])


def inference_model(cfg: DictConfig, hooks: PluginHooks) -> tuple[ModelParts, dict[str, dict[str, torch.Tensor]]]:
    """The components and every unit's full weights (no optimizer state), at TP=1, on the configured
    device (``execution.device``: a GPU when one is available), loaded unit by unit."""
    parts = build_model(cfg, hooks)
    device = select_device(cfg)
    init = initializer(cfg, parts)
    weights = {unit: {n: t.to(device) for n, t in init(unit, parts.variables[unit_role(unit)]).items()}
               for unit in parts.program.units()}
    return parts, weights


_TOKENIZER_LIMIT = 1 << 30  # bytes; real tokenizer.json files are a few MB


def tokenizer_for(cfg: DictConfig):
    """The tokenizer saved with the model ``cfg`` loads (in its checkpoint, checked against the manifest, or
    in its Hugging Face directory), else ``data.tokenizer``."""
    home = Path(cfg.checkpoint.load or cfg.model.hf_checkpoint)
    path = home / "tokenizer.json"
    if path.exists() and cfg.checkpoint.load is not None:
        from tokenizers import Tokenizer

        data = read_verified(home, "tokenizer.json", _TOKENIZER_LIMIT)
        try:
            return Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 (a bad encoding, or the Rust side's plain Exceptions)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"{path} is not a valid tokenizer.json ({first[:200]})") from None
    if path.exists():
        return load_tokenizer(str(path))
    if cfg.data.tokenizer is not None:
        return load_tokenizer(cfg.data.tokenizer)
    raise DataError(f"{home} holds no tokenizer.json; set data.tokenizer=DIR")


def evaluate_mnli(cfg: DictConfig, hooks: PluginHooks, max_new_tokens: int = 8) -> dict:
    """``{"accuracy", "examples", "correct"}``: greedy generation of each row's label after ``target:``."""
    if cfg.data.path is None:
        raise DataError("data.path: eval --task mnli needs MNLI rows (premise, hypothesis, label)")
    template = resolve_template("mnli")
    source = tokenizer_source(cfg)
    if source is None:
        raise DataError("data.tokenizer: eval --task mnli needs a tokenizer; set data.tokenizer or model.hf_checkpoint")
    tokenizer = load_tokenizer(*source)
    eos_id = tokenizer.token_to_id(EOS)
    parts, weights = inference_model(cfg, hooks)
    path = resolve_data_path(cfg.data.path)
    correct = examples = 0
    for number, row in read_rows(path):
        prompt, target = template.render(row, f"{path} row {number}")
        expected = target.replace(EOS, "").strip()
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        new = generate(parts.modules, weights, cfg.model.layers, ids, max_new_tokens, eos_id=eos_id)
        predicted = tokenizer.decode(new, skip_special_tokens=False).replace(EOS, "").strip()
        correct += predicted == expected
        examples += 1
    if examples == 0:
        raise DataError(f"{path}: the dataset is empty")
    return {"accuracy": correct / examples, "examples": examples, "correct": correct}
