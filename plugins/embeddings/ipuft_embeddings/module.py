"""The GPT-J embeddings module.

Under tensor parallelism each rank holds a contiguous block of the (padded) vocabulary: ids outside it
contribute zeros, and the partial lookups are summed over the TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ipuft.components import Init, VariableSpec, specs_from_module
from ipuft.ops import Embedding
from ipuft.parallel import vocab_parallel_embedding
from ipuft.sharding import VOCAB_SHARDED


class GPTJEmbeddings(torch.nn.Module):
    """``input_ids[B, T] -> hidden[B, T, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout_prob: float = 0.0, tensor_parallel: int = 1):
        super().__init__()
        local_rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.wte = Embedding(local_rows, hidden_size)  # its gradient taken over micro-batches (ipuft.ops)
        self.dropout_prob = dropout_prob
        self.tensor_parallel = tensor_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = vocab_parallel_embedding(self.wte, input_ids, self.tensor_parallel)
        return F.dropout(hidden, self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        return specs_from_module(self, {"wte.weight": Init("normal", 0.02)})

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {"wte.weight": "transformer.wte.weight"}
