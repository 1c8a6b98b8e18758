"""One GPT-J decoder layer in plain PyTorch.

``x + attention(ln(x)) + mlp(ln(x))``: a single layer norm feeds attention and MLP in parallel. Attention is
core's (:class:`ipuft.attention.CausalSelfAttention`) with interleaved rotary embeddings on the first
``rotary_dim`` dimensions of each head of q and k, and no biases; it takes the optional per-layer KV cache of
generation (``forward(x, cache)``; ``None`` in training). The MLP is fc_in → gelu_new → fc_out, with biases.

Under tensor parallelism the block is built with the whole model's sizes and ``tensor_parallel``, and holds
this rank's share of the heads and of the MLP width (q/k/v and fc_in column-sharded, out_proj and fc_out
row-sharded). Because attention and MLP run in parallel, one all-reduce (core's
``reduce_from_tensor_parallel``) sums both partial outputs; fc_out's bias is added once, after it. At TP=1 the
collectives are the identity.

On the CPU, ``gelu_new`` of 16-bit activations is computed in float32 and rounded once (and so is the
attention where ATen's 16-bit kernel is the slower, :func:`ipuft.ops.attention_in_float32`); elsewhere both run
in the tensors' dtype.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.attention import CausalSelfAttention, InterleavedRotary
from ipuft.attention import apply_interleaved_rotary as apply_interleaved_rotary  # re-exported: the tests' name
from ipuft.components import Init, VariableSpec, specs_from_module
from ipuft.ops import Linear
from ipuft.parallel import copy_to_tensor_parallel, reduce_from_tensor_parallel

if TYPE_CHECKING:
    from ipuft.generate import LayerKVCache

_GELU_K, _GELU_A = math.sqrt(2.0 / math.pi), 0.044715
_16_BIT = (torch.bfloat16, torch.float16)  # gelu_new computes them in float32 on the CPU
GELU_CHUNK = 1 << 18  # elements: 1 MiB of float32 a pass, in cache; a multiple of every vector width


class _CpuGeluNew(torch.autograd.Function):
    """``gelu_new`` on CPU tensors, faster than ATen's tanh-GELU kernel there (``python bench/gelu.py``).

    ``0.5·x·(1 + tanh(z)) = x·σ(2z)``: ATen's CPU ``sigmoid`` is several times faster than its ``tanh``,
    and than ``gelu(approximate="tanh")``, within 1 ulp-scale of the tanh form (5e-7 at most, in float32,
    against float64). A 16-bit ``x`` is computed in float32 and rounded once, as ATen's own 16-bit kernel
    does. The backward is ATen's own ``gelu_backward``, in
    ``x``'s dtype, exactly as ``F.gelu`` would give; composing it from elementwise ops measured slower.

    A tensor larger than :data:`GELU_CHUNK` elements is taken that many at a time, so that the float32
    intermediates stay in cache instead of being faulted in afresh over the whole tensor (figures at GPT-J-6B's
    width in docs/performance.md, from ``python bench/gelu.py``). The same values, element
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


class GPTJMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.fc_in = Linear(hidden_size, intermediate_size)
        self.fc_out = Linear(intermediate_size, hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """fc_out without its bias (partial under TP): the block adds the bias once, after the reduce."""
        return self.fc_out.project(gelu_new(self.fc_in(h)), bias=False, skip_in_recompute=True)


class GPTJDecoderBlock(nn.Module):
    """``hidden[B, T, H] -> hidden[B, T, H]`` for one layer (``cache``: this layer's KV cache, when generating)."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, intermediate_size: int, rotary_dim: int,
                 rotary_base: float = 10000.0, layer_norm_epsilon: float = 1e-5, dropout_prob: float = 0.0,
                 attention_kernel: str = "sdpa", tensor_parallel: int = 1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
        # The attention's output is read only by the layer's output, so a recompute skips its projection.
        rotary = InterleavedRotary(head_dim, rotary_dim, rotary_base)
        self.attn = CausalSelfAttention(hidden_size, heads, head_dim, rotary, tensor_parallel=tensor_parallel,
                                        output_name="out_proj", kernel=attention_kernel, skip_output_in_recompute=True)
        self.mlp = GPTJMLP(hidden_size, intermediate_size // tensor_parallel)
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

    @property
    def projections(self) -> dict[str, str]:
        """Each shared projection name and its module's path, for adapters (``plugins.lora.targets``): GPT-J's
        MLP is ``fc_in`` (up) and ``fc_out`` (down), without a gate."""
        return {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.out_proj",
                "up": "mlp.fc_in", "down": "mlp.fc_out"}

    def hf_config(self) -> dict:
        """This block's part of a Hugging Face config.json."""
        return {"activation_function": "gelu_new"}

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        prefix = f"transformer.h.{layer}."
        local = {"norm.weight": "ln_1.weight", "norm.bias": "ln_1.bias"}
        return {name: prefix + local.get(name, name) for name, _ in self.named_parameters()}
