"""The GPT-J language-model head: final layer norm, projection with bias (its weight tied to the embeddings' table
with ``model.tie_embeddings``), mean cross-entropy.

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the module itself is in :mod:`ipuft_lm_head.module`, imported when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry
from ipuft.sharding import REPLICATED, VOCAB_SHARDED

if TYPE_CHECKING:
    from ipuft_lm_head.module import GPTJLMHead

NAME = "gptj"


def build(cfg: DictConfig) -> GPTJLMHead:
    from ipuft_lm_head.module import GPTJLMHead

    m = cfg.model
    return GPTJLMHead(m.hidden_size, m.embedding.vocab_size, m.layer_norm_epsilon, cfg.execution.tensor_parallel,
                      tied=m.tie_embeddings)


# The projection is sharded by vocabulary; the final layer norm is replicated.
SHARD_SPECS = {"norm.weight": REPLICATED, "norm.bias": REPLICATED, "proj.weight": VOCAB_SHARDED,
               "proj.bias": VOCAB_SHARDED}


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("head", NAME, build, "GPT-J LM head: ln_f, projection with bias (tied or not), mean cross-entropy",
                 shard_specs=SHARD_SPECS)
