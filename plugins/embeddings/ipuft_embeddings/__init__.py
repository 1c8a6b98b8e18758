"""GPT-J token embeddings: a lookup table and dropout (no position embeddings: GPT-J is rotary).

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the module itself is in :mod:`ipuft_embeddings.module`, imported when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry
from ipuft.sharding import VOCAB_SHARDED

if TYPE_CHECKING:
    from ipuft_embeddings.module import GPTJEmbeddings

NAME = "gptj"


def build(cfg: DictConfig) -> GPTJEmbeddings:
    from ipuft_embeddings.module import GPTJEmbeddings

    m = cfg.model
    return GPTJEmbeddings(m.embedding.vocab_size, m.hidden_size, m.dropout_prob, cfg.execution.tensor_parallel)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("embeddings", NAME, build, "GPT-J token embedding + dropout",
                 shard_specs={"wte.weight": VOCAB_SHARDED})  # a contiguous block of the vocabulary per TP rank
