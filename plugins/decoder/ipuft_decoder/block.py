"""One GPT-J decoder layer in plain PyTorch.

``x + attention(ln(x)) + mlp(ln(x))``: a single layer norm feeds attention and MLP in parallel.
Attention applies interleaved rotary embeddings to the first ``rotary_dim`` dimensions of each head of
q and k, with a causal mask; q/k/v/out have no bias. The MLP is fc_in → gelu_new → fc_out, with biases.

Under tensor parallelism the block is built with this rank's share of the heads and of the MLP width
(q/k/v and fc_in column-sharded, out_proj and fc_out row-sharded). Because attention and MLP run in
parallel, one all-reduce (core's ``reduce_from_tensor_parallel``) sums both partial outputs; fc_out's
bias is added once, after it. At TP=1 the collectives are the identity.

On the CPU, 16-bit attention without a cache is computed in float32 where ATen's 16-bit kernel is the
slower (:func:`ipuft.ops.attention_in_float32`: short heads, or no AVX-512 BF16), and ``gelu_new`` in
float32 rounded once; elsewhere both run in the tensors' dtype.

For inference, ``forward(x, cache)`` takes an optional per-layer key/value cache
(:class:`ipuft.generate.LayerKVCache`): the new tokens' positions start at ``cache.length``, their keys
(after rotary) and values are appended to it, and the queries attend over every cached and new key. A
batch of rows of different lengths is left-padded: the cache then carries each row's padding, which sets
the row's positions (its first real token is position 0) and hides its pad keys from every query. In
training the cache is ``None`` and nothing of this runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.components import Init, VariableSpec, specs_from_module
from ipuft.ops import Linear, attention_in_float32, output_projection
from ipuft.parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel

if TYPE_CHECKING:
    from ipuft.generate import LayerKVCache


_GELU_K, _GELU_A = math.sqrt(2.0 / math.pi), 0.044715
_16_BIT = (torch.bfloat16, torch.float16)  # gelu_new computes them in float32 on the CPU
GELU_CHUNK = 1 << 18  # elements: 1 MiB of float32 a pass, in cache; a multiple of every vector width


class _CpuGeluNew(torch.autograd.Function):
    """``gelu_new`` on CPU tensors, about twice as fast as ATen's tanh-GELU kernel there.

    ``0.5·x·(1 + tanh(z)) = x·σ(2z)``: ATen's CPU ``sigmoid`` is several times faster than its ``tanh``,
    and than ``gelu(approximate="tanh")`` (0.2 against 0.44 ms on a [512, 1024] tensor on the 2-core CI
    CPU; 0.8 ms for the same formula through ``tanh_``), within 1 ulp-scale of the tanh form (5e-7 at most,
    in float32, against float64). A 16-bit ``x`` is computed in float32 and rounded once, as ATen's own
    16-bit kernel does (0.28 against 0.51 ms in bfloat16). The backward is ATen's own ``gelu_backward``, in
    ``x``'s dtype, exactly as ``F.gelu`` would give; composing it from elementwise ops measured slower.

    A tensor larger than :data:`GELU_CHUNK` elements is taken that many at a time, so that the float32
    intermediates stay in cache (``python bench/gelu.py``, 2-core Sapphire Rapids, three runs): at GPT-J-6B's
    width, ``[256, 16384]`` and ``[1024, 16384]`` in bfloat16, 4.7–7.8 and 25–35 ms against 5.4–22 and 66–92 ms
    over the whole tensor at once (whose time varies with the fresh float32 temporaries it faults in) and
    6.2–9.5 and 30–40 ms for ATen's bfloat16 kernel; in float32 1.04–1.17× faster. The same values, element
    by element (a chunk is a multiple of every vector width, so ATen's loops split the work as before).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        if x.numel() <= GELU_CHUNK:
            return _sigmoid_form(x.float()).to(x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype)
        flat, flat_out = x.reshape(-1), out.view(-1)
        wide = x.dtype != torch.float32
        x32_buffer = torch.empty(GELU_CHUNK) if wide else None  # a 16-bit chunk in float32
        z_buffer = torch.empty(GELU_CHUNK) if wide else None  # its result before the rounding
        for start in range(0, flat.numel(), GELU_CHUNK):
            piece, piece_out = flat[start : start + GELU_CHUNK], flat_out[start : start + GELU_CHUNK]
            n = piece.numel()
            if wide:
                piece_out.copy_(_sigmoid_form(x32_buffer[:n].copy_(piece), out=z_buffer[:n]))
            else:
                _sigmoid_form(piece, out=piece_out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def _sigmoid_form(x32: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x·σ(2·√(2/π)·(x + 0.044715·x³))`` of float32 ``x32`` (into ``out`` when given)."""
    k = torch.tensor(2.0 * _GELU_K)
    return torch.addcmul(k, x32, x32, value=2.0 * _GELU_K * _GELU_A, out=out).mul_(x32).sigmoid_().mul_(x32)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's activation, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    if x.device.type == "cpu" and (x.dtype == torch.float32 or x.dtype in _16_BIT):
        return _CpuGeluNew.apply(x)
    return F.gelu(x, approximate="tanh")


def rotary_rotor(positions: int, rotary_dim: int, head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """Unit complex numbers ``[positions, 1, head_dim // 2]``: pair ``i`` of a head turns by
    ``position · base^(-2i/rotary_dim)`` when ``i < rotary_dim / 2``, and by angle 0 (times exactly 1)
    past it, so that one contiguous complex multiply covers every pair of a head."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    angles = torch.outer(torch.arange(positions, device=device).float(), 1.0 / (base**exponents))
    angles = F.pad(angles, (0, head_dim // 2 - rotary_dim // 2))
    return torch.polar(torch.ones_like(angles), angles)[:, None, :]


def _as_pairs(x: torch.Tensor) -> torch.Tensor:
    """The last dimension of float32 ``x`` as complex numbers, one per adjacent pair (a view)."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def apply_interleaved_rotary(x: torch.Tensor, rotor: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair ``(x[2i], x[2i+1])`` of ``x[B, T, heads, head_dim]`` by its angle (the
    ``rotor`` of :func:`rotary_rotor`): GPT-J's interleaved ("rotate every two") rotary, as one complex
    multiplication of the whole head; the pairs past ``rotary_dim`` are multiplied by exactly 1.

    With autograd the product is a new tensor, and autograd turns the gradient back by the conjugate rotor:
    views and one multiply each way. ``x`` is a projection's fresh output, which nothing else reads:
    without autograd, float32 is rotated in place.
    """
    if x.dtype != torch.float32:
        return apply_interleaved_rotary(x.float(), rotor).to(x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return torch.view_as_real(_as_pairs(x) * rotor).flatten(-2)
    _as_pairs(x).mul_(rotor)
    return x


class GPTJAttention(nn.Module):
    def __init__(self, hidden_size: int, heads: int, head_dim: int, rotary_dim: int, rotary_base: float,
                 kernel: str) -> None:
        super().__init__()
        inner = heads * head_dim
        self.q_proj = Linear(hidden_size, inner, bias=False)
        self.k_proj = Linear(hidden_size, inner, bias=False)
        self.v_proj = Linear(hidden_size, inner, bias=False)
        self.out_proj = Linear(inner, hidden_size, bias=False)
        self.heads, self.head_dim = heads, head_dim
        self.rotary_dim, self.rotary_base = rotary_dim, rotary_base
        self.kernel = kernel
        self._rotors: dict[tuple, torch.Tensor] = {}

    def _rotor(self, start: int, length: int, device: torch.device) -> torch.Tensor:
        """The rotor of positions ``start … start + length - 1``.

        Without a cache (``start`` 0) there is one small table per sequence length and device. A cached
        step slices a table whose length is the next power of two, so that decoding makes few tables.
        """
        size = length if start == 0 else 1 << (start + length - 1).bit_length()
        key = (size, device)
        if key not in self._rotors:
            self._rotors[key] = rotary_rotor(size, self.rotary_dim, self.head_dim, self.rotary_base, device)
        return self._rotors[key][start : start + length]

    def forward(self, h: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        split = (self.heads, self.head_dim)
        new = h.shape[1]
        mask = None
        if cache is not None and cache.pad is not None:  # left-padded rows: per-row positions, pad keys hidden
            positions = cache.positions(new, h.device)
            table = self._rotor(0, 1 << (cache.length + new - 1).bit_length(), h.device)  # covers every position
            rotor = table[positions]  # [B, T, 1, head_dim / 2]
            mask = cache.attention_mask(new, h.device)
        else:
            rotor = self._rotor(0 if cache is None else cache.length, new, h.device)
        q, k, v = (proj(h).unflatten(-1, split) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if cache is None and self.kernel == "sdpa" and attention_in_float32(h, self.head_dim, new):
            # Where ATen's 16-bit CPU flash attention is the slower (ipuft.ops.attention_in_float32): the rotary
            # (float32 anyway) and the attention stay in float32 up to the output. A cache keeps its dtype.
            q, k, v = q.float(), k.float(), v.float()
        q = apply_interleaved_rotary(q, rotor).transpose(1, 2)
        k = apply_interleaved_rotary(k, rotor).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)  # every key and value so far: [B, heads, T_past + T, head_dim]
        out = self._attend(q, k, v, mask).to(h.dtype).transpose(1, 2).flatten(-2)
        return output_projection(self.out_proj.weight, out)  # partial under TP

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of the last ``T_q`` positions over all ``T_k``: query i sees keys ≤ T_k - T_q + i
        (and of those only the ones ``mask[B, 1, T_q, T_k]`` allows, when given)."""
        t_q, t_k = q.shape[-2], k.shape[-2]
        if mask is not None:
            if self.kernel == "sdpa":
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1) @ v
        if self.kernel == "sdpa":
            if t_q == t_k:  # no past: the plain causal mask
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if t_q == 1:  # one new token sees everything
                return F.scaled_dot_product_attention(q, k, v)
            mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
        return scores.masked_fill(~causal, torch.finfo(scores.dtype).min).softmax(-1) @ v


class GPTJMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.fc_in = Linear(hidden_size, intermediate_size)
        self.fc_out = Linear(intermediate_size, hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """fc_out without its bias (partial under TP): the block adds the bias once, after the reduce."""
        return output_projection(self.fc_out.weight, gelu_new(self.fc_in(h)))


class GPTJDecoderBlock(nn.Module):
    """``hidden[B, T, H] -> hidden[B, T, H]`` for one layer (``cache``: this layer's KV cache, when generating)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, intermediate_size: int, rotary_dim: int,
                 rotary_base: float = 10000.0, layer_norm_epsilon: float = 1e-5, dropout_prob: float = 0.0,
                 attention_kernel: str = "sdpa") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
        self.attn = GPTJAttention(hidden_size, heads, head_dim, rotary_dim, rotary_base, attention_kernel)
        self.mlp = GPTJMLP(hidden_size, intermediate_size)
        self.dropout_prob = dropout_prob

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        h = copy_to_tensor_parallel(self.norm(x))
        out = reduce_from_tensor_parallel(self.attn(h, cache) + self.mlp(h)) + self.mlp.fc_out.bias
        return x + F.dropout(out, self.dropout_prob, self.training)

    def variable_specs(self) -> list[VariableSpec]:
        normal = Init("normal", 0.02)
        inits = {name: normal for name, _ in self.named_parameters()}
        inits.update({"norm.weight": Init("ones"), "norm.bias": Init("zeros"),
                      "mlp.fc_in.bias": Init("zeros"), "mlp.fc_out.bias": Init("zeros")})
        return specs_from_module(self, inits)

    def hf_config(self) -> dict:
        """This block's part of a Hugging Face config.json."""
        return {"activation_function": "gelu_new"}

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        prefix = f"transformer.h.{layer}."
        local = {"norm.weight": "ln_1.weight", "norm.bias": "ln_1.bias"}
        return {name: prefix + local.get(name, name) for name, _ in self.named_parameters()}
