"""The GPT-J language-model head module.

Under tensor parallelism the projection is sharded by vocabulary (padded to a multiple of TP × 16; padded
columns never win) and the loss is core's vocabulary-parallel cross-entropy
(:func:`ipuft.parallel.vocab_parallel_cross_entropy`), so the full logits are never gathered for it.
"""

from __future__ import annotations

import torch

from ipuft.components import IGNORE_INDEX, Init, VariableSpec, specs_from_module, tie
from ipuft.ops import Linear
from ipuft.parallel import vocab_parallel_head
from ipuft.sharding import VOCAB_SHARDED


class GPTJLMHead(torch.nn.Module):
    """``hidden[B, T, H] -> logits[B, T, V]``, or the mean loss when ``labels[B, T]`` are given."""

    def __init__(self, hidden_size: int, vocab_size: int, layer_norm_epsilon: float = 1e-5,
                 tensor_parallel: int = 1, tied: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
        local_rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.proj = Linear(hidden_size, local_rows)
        self.vocab_size, self.tensor_parallel, self.tied = vocab_size, tensor_parallel, tied

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # The loss and its softmax are float32 whatever the weights' precision.
        return vocab_parallel_head(self.proj, self.norm(hidden), labels, self.vocab_size, self.tensor_parallel,
                                   IGNORE_INDEX)

    def variable_specs(self) -> list[VariableSpec]:
        inits = {"norm.weight": Init("ones"), "norm.bias": Init("zeros"),
                 "proj.weight": Init("normal", 0.02), "proj.bias": Init("zeros")}
        specs = specs_from_module(self, inits)
        return tie(specs, "proj.weight", "embeddings.wte.weight") if self.tied else specs

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        tied = {} if self.tied else {"proj.weight": "lm_head.weight"}  # a tied model has no lm_head.weight
        return {"norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias", **tied,
                "proj.bias": "lm_head.bias"}
