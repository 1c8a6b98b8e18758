"""The Llama architecture's components in plain PyTorch: one decoder layer and the LM head (its token
embeddings are core's, :class:`ipuft.embeddings.TokenEmbeddings`).

A layer is ``h = x + o(attention(rms(x)))``, then ``h + down(silu(gate(rms(h))) · up(rms(h)))``, without
biases (Qwen2's q/k/v biases, and Llama's optional attention biases, as options). Attention is core's
(:class:`ipuft.attention.CausalSelfAttention`), causal with grouped-query heads (``kv_heads`` key/value heads,
each serving ``heads / kv_heads`` query heads) and rotary embeddings on halves ("rotate_half": dimension ``i``
pairs with ``i + head_dim/2``) over the whole head, from ``rope_theta`` and, for Llama 3.1, its
``rope_scaling`` of the frequencies.

Under tensor parallelism a layer holds ``heads / TP`` query heads, the matching key/value heads, and
``intermediate / TP`` of the MLP: q, k, v, gate and up are column-sharded, o and down row-sharded, and one
all-reduce after each of attention and MLP sums the partial outputs (biases of o added once, after it). When
TP does not divide ``kv_heads`` the key/value projections are replicated instead: every rank computes all
key/value heads and uses those its query heads read; their gradients are partial on each rank and summed
over TP (:func:`ipuft.parallel.copy_to_tensor_parallel` on the weights). That costs each rank the full
k/v weights, their optimizer state and their FLOPs, which ``ipuft plan`` shows.

RMSNorm is computed in float32 and its result rounded to the weights' dtype before the gain, as transformers
does; the rotary tables are float32 and cast to the activations' dtype. On the CPU, 16-bit attention without a
cache (training) computes its rotary and attention in float32 where ATen runs that faster
(:func:`ipuft.ops.attention_in_float32`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.attention import CausalSelfAttention, HalvesRotary, current_layer
from ipuft.components import IGNORE_INDEX, Init, VariableSpec, specs_from_module, tie
from ipuft.ops import Linear
from ipuft.parallel import (
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
    vocab_parallel_head,
)
from ipuft.sharding import VOCAB_SHARDED

if TYPE_CHECKING:
    from ipuft.generate import LayerKVCache


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``: the statistics in float32, the result rounded to ``x``'s dtype
    before the gain."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Partial under TP. The layer's last op: in a recompute its value is never read, so its forward matmul
        is skipped (:func:`ipuft.ops.output_projection`; the attention's output projection is read by the MLP's
        norm, so it is not)."""
        return self.down_proj.project(F.silu(self.gate_proj(h)) * self.up_proj(h), skip_in_recompute=True)


class LlamaDecoderBlock(nn.Module):
    """``hidden[B, T, H] -> hidden[B, T, H]`` for one layer (``cache``: this layer's KV cache, when generating)."""

    def __init__(self, hidden_size: int, intermediate_size: int, heads: int, kv_heads: int, head_dim: int,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 qkv_bias: bool = False, output_bias: bool = False, dropout_prob: float = 0.0,
                 tensor_parallel: int = 1, sliding_window: int | None = None,
                 max_window_layers: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = CausalSelfAttention(hidden_size, heads, head_dim,
                                             HalvesRotary(head_dim, head_dim, rope_theta, rope_scaling),
                                             kv_heads=kv_heads, tensor_parallel=tensor_parallel, qkv_bias=qkv_bias,
                                             output_bias=output_bias, output_name="o_proj")
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = LlamaMLP(hidden_size, intermediate_size // tensor_parallel)
        self.dropout_prob = dropout_prob
        # Each query sees its last sliding_window positions (Mistral), on the layers from max_window_layers on
        # (Qwen2; None: every layer).
        self.sliding_window, self.max_window_layers = sliding_window, max_window_layers

    def window(self) -> int | None:
        """The window of the layer running now (:func:`ipuft.attention.current_layer`)."""
        if self.sliding_window is None or not self.max_window_layers:
            return self.sliding_window
        layer = current_layer()
        if layer is None:
            raise RuntimeError("a Llama block with max_window_layers runs as one decoder layer: call it under "
                               "ipuft.attention.decoder_layer, as the engine does")
        return self.sliding_window if layer >= self.max_window_layers else None

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        attn = self.self_attn(copy_to_tensor_parallel(self.input_layernorm(x)), cache, window=self.window())
        attn = reduce_from_tensor_parallel(attn)
        if self.self_attn.o_proj.bias is not None:
            attn = attn + self.self_attn.o_proj.bias
        h = x + F.dropout(attn, self.dropout_prob, self.training)
        mlp = reduce_from_tensor_parallel(self.mlp(copy_to_tensor_parallel(self.post_attention_layernorm(h))))
        return h + F.dropout(mlp, self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        inits = {name: Init("normal", 0.02) for name, _ in self.named_parameters()}
        inits.update({name: Init("ones") for name in ("input_layernorm.weight", "post_attention_layernorm.weight")})
        inits.update({name: Init("zeros") for name, _ in self.named_parameters() if name.endswith(".bias")})
        return specs_from_module(self, inits)

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        return {name: f"model.layers.{layer}.{name}" for name, _ in self.named_parameters()}


class LlamaLMHead(nn.Module):
    """Final RMSNorm and an untied projection without bias: ``hidden[B, T, H] -> logits[B, T, V]``, or the mean
    cross-entropy (float32) when ``labels[B, T]`` are given; under TP sharded by vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float = 1e-6, tensor_parallel: int = 1,
                 tied: bool = False):
        super().__init__()
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.lm_head = Linear(hidden_size, rows, bias=False)
        self.vocab_size, self.tensor_parallel, self.tied = vocab_size, tensor_parallel, tied

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return vocab_parallel_head(self.lm_head, self.norm(hidden), labels, self.vocab_size, self.tensor_parallel,
                                   IGNORE_INDEX)

    def variable_specs(self) -> list[VariableSpec]:
        specs = specs_from_module(self, {"norm.weight": Init("ones"), "lm_head.weight": Init("normal", 0.02)})
        return tie(specs, "lm_head.weight", "embeddings.embed_tokens.weight") if self.tied else specs

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        tied = {} if self.tied else {"lm_head.weight": "lm_head.weight"}  # a tied model has no lm_head.weight
        return {"norm.weight": "model.norm.weight", **tied}
