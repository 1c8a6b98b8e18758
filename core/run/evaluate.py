"""``ipuft eval``: loss and perplexity, and MNLI accuracy (``ipuft generate`` is :mod:`ipuft.run.generate`).

Everything runs through an inference engine (the model's weights in the variable store, no optimizer
state) and layer-major passes, so these commands hold one unit on the device like training does.

MNLI accuracy has two modes. ``score`` (the standard way to score a classification with a language
model) compares the log-likelihood of each label's target text after the prompt, in one forward pass over
every row and label, without generating. ``generate`` is the reference's validation: greedy generation of
the text after ``target:``, where a prediction that matches no label counts as wrong.
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig

from ipuft.components import IGNORE_INDEX
from ipuft.data.files import read_rows, resolve_data_path
from ipuft.data.templates import resolve_template
from ipuft.data.tokenizer import EOS, load_tokenizer, specials, tokenizer_source
from ipuft.data.tokens import TokenDataset, data_source
from ipuft.engine.generation import generate
from ipuft.engine.inference import LayerMajor, dataset_loss
from ipuft.errors import DataError
from ipuft.parallel import collective_errors
from ipuft.plugins import PluginHooks
from ipuft.run.runtime import inference_engine

MNLI_MODES = ("score", "generate")


class Measured:
    """The ``--json`` figures of the passes run after it is made: tokens per second and the device peak."""

    def __init__(self, engine) -> None:
        engine.store.reset_peak()
        self.engine, self.began = engine, time.perf_counter()

    def figures(self, tokens: int) -> dict:
        return {"tokens_per_s": tokens / (time.perf_counter() - self.began),
                "device_peak_bytes": self.engine.store.device_peak}


def evaluate_loss(cfg: DictConfig, hooks: PluginHooks, dataset: TokenDataset | None = None) -> dict:
    """``{"loss", "perplexity", "tokens", "tokens_per_s", "device_peak_bytes"}`` over every row of
    ``data.path`` (or of ``dataset``), once, in order."""
    if dataset is None and cfg.data.path is None:
        raise DataError("data.path: eval needs a dataset; set data.path=FILE")
    dataset = dataset if dataset is not None else data_source(cfg)
    assert isinstance(dataset, TokenDataset)
    engine = inference_engine(cfg, hooks)
    measured = Measured(engine)
    with collective_errors(engine.layout):
        result = dataset_loss(engine, dataset, cfg.execution.micro_batch_size)
    return {**result, **measured.figures(result["tokens"])}


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def label_log_likelihoods(runner: LayerMajor, prompts: list[list[int]],
                          candidates: list[list[int]]) -> list[list[float]]:
    """For each of ``prompts`` and each candidate continuation, the sum of the continuation's token
    log-probabilities after the prompt: one forward pass over every pair, right-padded (under the causal
    mask a real token never sees the pads after it)."""
    pairs = [(p, c) for p in prompts for c in candidates]
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in pairs], dtype=torch.long)
    # Position t predicts token t + 1: the head runs only where a candidate token is predicted.
    span = max(len(c) for c in candidates)
    where = torch.zeros(len(pairs), span, dtype=torch.long)
    targets = torch.full((len(pairs), span), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(pairs):
        where[i] = len(p) - 1
        where[i, : len(c)] += torch.arange(len(c))
        targets[i, : len(c)] = torch.tensor(c)
    logits = runner.vocabulary(runner.head(runner.hidden(ids), where)).float()
    targets = targets.to(logits.device)
    keep = targets != IGNORE_INDEX
    log_probs = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    sums = (log_probs * keep).sum(-1).tolist()
    return [sums[i : i + len(candidates)] for i in range(0, len(sums), len(candidates))]


def evaluate_mnli(cfg: DictConfig, hooks: PluginHooks, mode: str = "score", batch_size: int = 8,
                  max_new_tokens: int = 8) -> dict:
    """``{"accuracy", "examples", "correct", "mode", "tokens_per_s", "device_peak_bytes"}`` over the MNLI rows
    of ``data.path``, ``batch_size`` rows per pass (see the module docstring for the two modes)."""
    if mode not in MNLI_MODES:
        raise ValueError(f"mode must be one of {MNLI_MODES}, not {mode!r}")
    if cfg.data.path is None:
        raise DataError("data.path: eval --task mnli needs MNLI rows (premise, hypothesis, label)")
    template = resolve_template("mnli")
    source = tokenizer_source(cfg)
    if source is None:
        raise DataError("data.tokenizer: eval --task mnli needs a tokenizer; set data.tokenizer or model.hf_checkpoint")
    tokenizer = load_tokenizer(*source)
    prefix = list(specials(tokenizer, cfg).prefix)  # what the tokenizer puts first, as training data has it
    path = resolve_data_path(cfg.data.path)
    examples = []
    for number, row in read_rows(path):
        prompt, target = template.render(row, f"{path} row {number}")
        examples.append((prefix + tokenizer.encode(prompt, add_special_tokens=False).ids,
                         target.replace(EOS, "").strip()))
    if not examples:
        raise DataError(f"{path}: the dataset is empty")
    labels = [template.labels[k] for k in sorted(template.labels)]
    engine = inference_engine(cfg, hooks)
    runner = LayerMajor(engine)
    measured = Measured(engine)
    correct = tokens = 0
    if mode == "score":
        # Each label's text exactly as the template renders it after the prompt, tokenized on its own as in training.
        candidates = [tokenizer.encode(template.target.format(label=name), add_special_tokens=False).ids
                      for name in labels]
        for chunk in batches(examples, batch_size):
            scores = label_log_likelihoods(runner, [ids for ids, _ in chunk], candidates)
            for (_, expected), row_scores in zip(chunk, scores):
                correct += labels[max(range(len(labels)), key=row_scores.__getitem__)] == expected
            tokens += sum(len(ids) + len(c) for ids, _ in chunk for c in candidates)
    else:
        eos_id = tokenizer.token_to_id(EOS)
        for chunk in batches(examples, batch_size):
            new = generate(runner, [ids for ids, _ in chunk], max_new_tokens, eos_id=eos_id)
            for (_, expected), ids in zip(chunk, new):
                correct += tokenizer.decode(ids, skip_special_tokens=False).replace(EOS, "").strip() == expected
            tokens += sum(len(ids) for ids in new)
    return {"accuracy": correct / len(examples), "examples": len(examples), "correct": correct, "mode": mode,
            **measured.figures(tokens)}
