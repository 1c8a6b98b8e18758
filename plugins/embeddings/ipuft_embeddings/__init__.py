"""GPT-J token embeddings: a lookup table and dropout (no position embeddings: GPT-J is rotary).

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the module itself is in :mod:`ipuft_embeddings.module`, imported when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.program import Op, Phase, Stage, StepProgram
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
    registry.add("embeddings", NAME, build, "GPT-J token embedding + dropout")


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int):
    if (role, name) != ("embeddings", NAME):
        return None
    return {"wte.weight": VOCAB_SHARDED}


@hookimpl
def ipuft_emit_phases(program: StepProgram, role: str, name: str):
    if (role, name) != ("embeddings", NAME):
        return None
    program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,)))
    # As in the reference: the embedding gradient is used straight away, never stored, and this phase
    # also finishes the global norm that every optimizer step needs.
    program.emit(
        Stage.EMBEDDINGS_BACKWARD_OPTIMIZER,
        Phase("embeddings", None, (Op.BACKWARD, Op.GLOBAL_NORM, Op.OPTIMIZER_STEP)),
    )
    return True
