"""GPT-J token embeddings: a lookup table and dropout (no position embeddings: GPT-J is rotary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, Init, VariableSpec, specs_from_module
from ipuft.program import Op, Phase, Stage, StepProgram
from ipuft.sharding import ShardSpec

NAME = "gptj"
# The reference pads the vocabulary up to a multiple of TP × 16 before sharding it.
VOCAB_PAD_MULTIPLE = 16


class GPTJEmbeddings(torch.nn.Module):
    """``input_ids[B, T] -> hidden[B, T, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout_prob: float = 0.0) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, hidden_size)
        self.dropout_prob = dropout_prob

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.wte(input_ids), self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        return specs_from_module(self, {"wte.weight": Init("normal", 0.02)})

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {"wte.weight": "transformer.wte.weight"}


def build(cfg: DictConfig) -> GPTJEmbeddings:
    m = cfg.model
    return GPTJEmbeddings(m.embedding.vocab_size, m.hidden_size, m.dropout_prob)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("embeddings", NAME, build, "GPT-J token embedding + dropout")


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int):
    if (role, name) != ("embeddings", NAME):
        return None
    return {"wte.weight": ShardSpec(tp_dim=0, pad_multiple=VOCAB_PAD_MULTIPLE)}


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
