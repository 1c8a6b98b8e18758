"""GPT-J's token embeddings: core's :class:`ipuft.embeddings.TokenEmbeddings` with GPT-J's names (the table
``wte``, ``transformer.wte.weight`` in a Hugging Face checkpoint).

The hooks import no torch, so that discovering the plugin (``ipuft --help``) stays fast: the module is imported
when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry
from ipuft.sharding import VOCAB_SHARDED

if TYPE_CHECKING:
    from ipuft.embeddings import TokenEmbeddings

NAME = "gptj"


def build(cfg: DictConfig) -> TokenEmbeddings:
    from ipuft.embeddings import TokenEmbeddings

    m = cfg.model
    return TokenEmbeddings(m.embedding.vocab_size, m.hidden_size, m.dropout_prob, cfg.execution.tensor_parallel,
                           table_name="wte", hf_name="transformer.wte.weight")


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("embeddings", NAME, build, "GPT-J token embedding + dropout",
                 shard_specs={"wte.weight": VOCAB_SHARDED})  # a contiguous block of the vocabulary per TP rank
