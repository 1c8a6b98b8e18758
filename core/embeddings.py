"""Token embeddings, one module for every decoder family: a lookup table and dropout (no position embeddings:
the shipped families are rotary).

A family differs only in names: the table's attribute (``wte``, ``embed_tokens``), and so its variable's name
in ipuft's checkpoints, and its Hugging Face name. Under tensor parallelism each rank holds a contiguous block
of the (padded) vocabulary (:data:`ipuft.sharding.VOCAB_SHARDED`): ids outside it contribute zeros, and the
partial lookups are summed over the TP group (:func:`ipuft.parallel.vocab_parallel_embedding`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ipuft.components import Init, VariableSpec, specs_from_module
from ipuft.ops import Embedding
from ipuft.parallel import vocab_parallel_embedding
from ipuft.sharding import VOCAB_SHARDED


class TokenEmbeddings(torch.nn.Module):
    """``input_ids[B, T] -> hidden[B, T, H]``; the table is the attribute ``table_name`` (its variable
    ``<table_name>.weight``), named ``hf_name`` in a Hugging Face checkpoint."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout_prob: float = 0.0, tensor_parallel: int = 1, *,
                 table_name: str, hf_name: str) -> None:
        super().__init__()
        rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.add_module(table_name, Embedding(rows, hidden_size))  # its gradient taken over micro-batches (ipuft.ops)
        self.table_name, self.hf_name = table_name, hf_name
        self.dropout_prob, self.tensor_parallel = dropout_prob, tensor_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = vocab_parallel_embedding(getattr(self, self.table_name), input_ids, self.tensor_parallel)
        return F.dropout(hidden, self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        return specs_from_module(self, {f"{self.table_name}.weight": Init("normal", 0.02)})

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {f"{self.table_name}.weight": self.hf_name}
