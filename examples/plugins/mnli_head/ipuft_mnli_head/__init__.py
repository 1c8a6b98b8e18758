"""``mnli_classifier``: a 3-class MNLI classification head as an ipuft plugin (``model.head=mnli_classifier``).

The final layer norm and a ``[3, hidden]`` projection with bias read the hidden state at the position that
predicts the label: with ``data.packing=false`` and the ``mnli`` template, a row's labels are
``IGNORE_INDEX`` except on the target tokens, and the first labelled position's label is the first token of
`` entailment``, `` neutral`` or `` contradiction``, which names the class.

Those three token ids are ``plugins.mnli_head.label_token_ids``; left null (the default) they are derived from
the run's tokenizer, as the first token of the ``mnli`` template's target for each label (the shipped sample
tokenizer gives 347, 349, 350). Set them for another template, or where the run has no tokenizer.

This module holds the hooks only and imports no torch; the module is in :mod:`ipuft_mnli_head.module`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry
from ipuft.config import ConfigSectionRegistry
from ipuft.errors import ConfigError
from ipuft.sharding import REPLICATED

if TYPE_CHECKING:
    from ipuft_mnli_head.module import MNLIClassifier

NAME = "mnli_classifier"
SECTION = "mnli_head"
TEMPLATE = "mnli"
CLASSES = 3


@dataclass
class MNLIHeadOptions:
    """``plugins.mnli_head`` (used when ``model.head=mnli_classifier``)."""

    # The token ids that open the targets of entailment, neutral and contradiction, in that order (MNLI's
    # label order); null: derived from the run's tokenizer and the mnli template. OmegaConf reads
    # typing.Optional, not `X | None`.
    label_token_ids: Optional[list[int]] = None  # noqa: UP045


def label_token_ids(cfg: DictConfig) -> tuple[int, ...]:
    """The three label token ids: ``plugins.mnli_head.label_token_ids`` checked, or derived from the tokenizer."""
    key = f"plugins.{SECTION}.label_token_ids"
    given = cfg.plugins[SECTION].label_token_ids
    vocab = cfg.model.embedding.vocab_size
    if given is not None:
        ids = tuple(int(i) for i in given)
        if len(ids) != CLASSES or len(set(ids)) != CLASSES or not all(0 <= i < vocab for i in ids):
            raise ConfigError(f"{key}: must be {CLASSES} distinct token ids in [0, {vocab}) (entailment, neutral, "
                              f"contradiction), got {list(ids)}")
        return ids
    from ipuft.data.templates import TEMPLATES
    from ipuft.data.tokenizer import load_tokenizer, tokenizer_source

    source = tokenizer_source(cfg)
    if source is None or cfg.data.template != TEMPLATE:
        why = "the run has no tokenizer" if source is None else f"data.template is not {TEMPLATE}"
        raise ConfigError(f"{key}: {why}, so the label tokens cannot be derived; set the {CLASSES} token ids that "
                          f"start the targets of entailment, neutral and contradiction")
    tokenizer = load_tokenizer(*source)
    template = TEMPLATES[TEMPLATE]
    ids = tuple(tokenizer.encode(template.target.format(label=template.labels[c]), add_special_tokens=False).ids[0]
                for c in range(CLASSES))
    if len(set(ids)) != CLASSES:
        raise ConfigError(f"{key}: the tokenizer {source[0]} starts two labels' targets with the same token "
                          f"({list(ids)}); set {CLASSES} distinct ids")
    return ids


def build(cfg: DictConfig) -> MNLIClassifier:
    from ipuft_mnli_head.module import MNLIClassifier

    if cfg.data.path is not None and cfg.data.packing:
        raise ConfigError(f"model.head: {NAME} reads one example per row, at its label; set data.packing=false")
    m = cfg.model
    return MNLIClassifier(m.hidden_size, label_token_ids(cfg), m.layer_norm_epsilon)


# Every TP rank computes the whole (tiny) head from the replicated hidden state: no collective, and each
# rank's input gradient is the full one the decoder's backward expects.
SHARD_SPECS = dict.fromkeys(("norm.weight", "norm.bias", "proj.weight", "proj.bias"), REPLICATED)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("head", NAME, build, "MNLI classifier: ln_f and a [3, hidden] projection at the label position",
                 shard_specs=SHARD_SPECS)


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, MNLIHeadOptions, used_when={"model.head": NAME})
