"""The Llama architecture's components in plain PyTorch: token embeddings, one decoder layer, the LM head.

A layer is ``h = x + o(attention(rms(x)))``, then ``h + down(silu(gate(rms(h))) · up(rms(h)))``, without
biases (Qwen2's q/k/v biases, and Llama's optional attention biases, as options). Attention is causal with
grouped-query heads (``kv_heads`` key/value heads, each serving ``heads / kv_heads`` query heads) and
rotary embeddings on halves ("rotate_half": dimension ``i`` pairs with ``i + head_dim/2``) over the whole
head, from ``rope_theta`` and, for Llama 3.1, its ``rope_scaling`` of the frequencies.

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

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.components import IGNORE_INDEX, Init, VariableSpec, specs_from_module
from ipuft.ops import Embedding, Linear, attention_in_float32, linear, output_projection
from ipuft.parallel import (
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
    tensor_parallel_rank,
    vocab_parallel_embedding,
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


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """``base^(-2i/head_dim)`` for each pair ``i`` (float32), scaled as ``scaling`` says: ``linear`` divides every
    frequency by ``factor``; ``llama3`` divides the low frequencies (wavelengths past the original context
    over ``low_freq_factor``) by ``factor``, keeps the high ones, and blends in between."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (base**exponents)
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~(wavelength > context / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, tensor_parallel: int,
                 rope_theta: float, rope_scaling: dict | None, qkv_bias: bool, output_bias: bool) -> None:
        super().__init__()
        self.heads = heads // tensor_parallel  # this rank's query heads
        self.group = heads // kv_heads  # query heads per key/value head
        self.kv_replicated = kv_heads % tensor_parallel != 0
        self.kv_heads = kv_heads if self.kv_replicated else kv_heads // tensor_parallel
        self.head_dim, self.tensor_parallel = head_dim, tensor_parallel
        self.q_proj = Linear(hidden_size, self.heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, self.kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, self.kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.heads * head_dim, hidden_size, bias=output_bias)
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position below ``length`` (a power of two or the sequence), ``[length, head_dim]``
        float32, each frequency twice (for both halves)."""
        key = (length, device)
        if key not in self._tables:
            inv = inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling).to(device)
            angles = torch.outer(torch.arange(length, device=device).float(), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self._tables[key] = (angles.cos(), angles.sin())
        return self._tables[key]

    def _local_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value heads of each of this rank's query heads, ``[B, heads, T, head_dim]``."""
        if self.kv_replicated and self.tensor_parallel > 1:
            first = tensor_parallel_rank() * self.heads
            index = torch.arange(first, first + self.heads, device=k.device) // self.group
            return k.index_select(1, index), v.index_select(1, index)
        if self.group == 1:
            return k, v
        b, kv, t, d = k.shape
        return (k[:, :, None].expand(b, kv, self.group, t, d).reshape(b, kv * self.group, t, d),
                v[:, :, None].expand(b, kv, self.group, t, d).reshape(b, kv * self.group, t, d))

    def _projection(self, proj: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        if not (self.kv_replicated and self.tensor_parallel > 1):
            return proj(h)
        # Every rank holds the whole projection and reads only its query heads' share: its gradient is partial
        # here, and summed over TP by the backward of the copy.
        bias = None if proj.bias is None else copy_to_tensor_parallel(proj.bias)
        return F.linear(h, copy_to_tensor_parallel(proj.weight), bias)

    def forward(self, h: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        b, new, _ = h.shape
        mask = None
        if cache is not None and cache.pad is not None:
            positions = cache.positions(new, h.device)  # [B, T]
            cos, sin = self._cos_sin(1 << (cache.length + new - 1).bit_length(), h.device)
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # [B, 1, T, D]
            mask = cache.attention_mask(new, h.device)
        else:
            start = 0 if cache is None else cache.length
            cos, sin = self._cos_sin(new if start == 0 else 1 << (start + new - 1).bit_length(), h.device)
            cos, sin = cos[start : start + new], sin[start : start + new]
        q = self.q_proj(h).view(b, new, self.heads, self.head_dim).transpose(1, 2)
        k = self._projection(self.k_proj, h).view(b, new, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self._projection(self.v_proj, h).view(b, new, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is None and attention_in_float32(h, self.head_dim, new):
            # Where ATen's 16-bit CPU flash attention is the slower (ipuft.ops.attention_in_float32): the rotary
            # and the attention run in float32 up to the output projection, as GPT-J's block does. A cache
            # keeps its dtype.
            q, k, v = q.float(), k.float(), v.float()
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(k, v)  # the key/value heads only: the cache stays kv_heads wide
        k, v = self._local_kv(k, v)
        out = self._attend(q, k, v, mask).to(h.dtype).transpose(1, 2).reshape(b, new, self.heads * self.head_dim)
        return linear(out, self.o_proj.weight)  # partial under TP; the bias is added after the reduce

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        t_q, t_k = q.shape[-2], k.shape[-2]
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if t_q == t_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if t_q == 1:
            return F.scaled_dot_product_attention(q, k, v)
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal)


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
        return output_projection(self.down_proj.weight, F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaDecoderBlock(nn.Module):
    """``hidden[B, T, H] -> hidden[B, T, H]`` for one layer (``cache``: this layer's KV cache, when generating)."""

    def __init__(self, hidden_size: int, intermediate_size: int, heads: int, kv_heads: int, head_dim: int,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 qkv_bias: bool = False, output_bias: bool = False, dropout_prob: float = 0.0,
                 tensor_parallel: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = LlamaAttention(hidden_size, heads, kv_heads, head_dim, tensor_parallel, rope_theta,
                                        rope_scaling, qkv_bias, output_bias)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = LlamaMLP(hidden_size, intermediate_size // tensor_parallel)
        self.dropout_prob = dropout_prob

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        attn = reduce_from_tensor_parallel(self.self_attn(copy_to_tensor_parallel(self.input_layernorm(x)), cache))
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


class LlamaEmbeddings(nn.Module):
    """``input_ids[B, T] -> hidden[B, T, H]``; under TP a contiguous block of the (padded) vocabulary per rank,
    the partial lookups summed over the group."""

    def __init__(self, vocab_size: int, hidden_size: int, dropout_prob: float = 0.0, tensor_parallel: int = 1):
        super().__init__()
        rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.embed_tokens = Embedding(rows, hidden_size)  # its gradient taken over micro-batches (ipuft.ops)
        self.dropout_prob, self.tensor_parallel = dropout_prob, tensor_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = vocab_parallel_embedding(self.embed_tokens, input_ids, self.tensor_parallel)
        return F.dropout(hidden, self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        return specs_from_module(self, {"embed_tokens.weight": Init("normal", 0.02)})

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {"embed_tokens.weight": "model.embed_tokens.weight"}


class LlamaLMHead(nn.Module):
    """Final RMSNorm and an untied projection without bias: ``hidden[B, T, H] -> logits[B, T, V]``, or the mean
    cross-entropy (float32) when ``labels[B, T]`` are given; under TP sharded by vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float = 1e-6, tensor_parallel: int = 1):
        super().__init__()
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.lm_head = Linear(hidden_size, rows, bias=False)
        self.vocab_size, self.tensor_parallel = vocab_size, tensor_parallel

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return vocab_parallel_head(self.lm_head, self.norm(hidden), labels, self.vocab_size, self.tensor_parallel,
                                   IGNORE_INDEX)

    def variable_specs(self) -> list[VariableSpec]:
        return specs_from_module(self, {"norm.weight": Init("ones"), "lm_head.weight": Init("normal", 0.02)})

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
