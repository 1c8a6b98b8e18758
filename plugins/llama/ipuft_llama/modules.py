"""The Llama architecture's components in plain PyTorch: one decoder layer and the LM head (its token
embeddings are core's, :class:`ipuft.embeddings.TokenEmbeddings`).

A Llama layer is ``h = x + o(attention(rms(x)))``, then ``h + down(silu(gate(rms(h))) · up(rms(h)))``, without
biases (Qwen2's q/k/v biases, and Llama's optional attention and MLP biases, as options). The other families
are the same block with what their :class:`~ipuft_llama.description.Description` says
(:class:`BlockArithmetic`): norms after attention and MLP too (Gemma's sandwich) or only there (OLMo 2), a
``1 + w`` gain, q/k norms, GeGLU with the tanh gelu, the softmax scale and a soft-cap, and per layer a sliding
window and a local rotary, read from :func:`ipuft.attention.current_layer`. Attention is core's
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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.attention import CausalSelfAttention, HalvesRotary, current_layer
from ipuft.components import IGNORE_INDEX, Init, VariableSpec, has_values, specs_from_module, tie
from ipuft.embeddings import TokenEmbeddings
from ipuft.ops import Linear
from ipuft.parallel import (
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from ipuft.sharding import VOCAB_SHARDED

if TYPE_CHECKING:
    from ipuft.generate import LayerKVCache


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · gain``, the statistics in float32. The gain is ``weight``, or ``1 + weight``
    with ``offset`` (Gemma); without ``gain_float32`` the normed value is rounded to ``x``'s dtype before the
    gain (Llama, Qwen), with it the gain multiplies the float32 value and the product is rounded (OLMo 2,
    Gemma), each as transformers computes it. ``partial``: the weight serves only this rank's heads under TP
    (q/k norms), so its gradient is summed over TP."""

    def __init__(self, hidden_size: int, eps: float, offset: bool = False, gain_float32: bool = False,
                 partial: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps, self.offset, self.gain_float32, self.partial = eps, offset, gain_float32, partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = copy_to_tensor_parallel(self.weight) if self.partial else self.weight
        if self.gain_float32:
            gain = 1.0 + weight.float() if self.offset else weight.float()
            return (normed * gain).to(x.dtype)
        return (1.0 + weight if self.offset else weight) * normed.to(x.dtype)


@dataclass(frozen=True)
class BlockArithmetic:
    """What a family's layer computes beyond its shapes (set from ``plugins.llama``): the norms' names at their
    four places (before attention, after it, before the MLP, after it; None: none there), their gain, the q/k
    norm (``head``, ``width`` or None), the MLP's activation and biases, the attention's scale and soft-cap, each
    layer's window (None: full causal), and the sliding layers' rotary base (None: the model's)."""

    norms: tuple[str | None, ...] = ("input_layernorm", None, "post_attention_layernorm", None)
    norm_offset: bool = False
    norm_gain_float32: bool = False
    qk_norm: str | None = None
    activation: str = "silu"
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None

    def norm(self, size: int, eps: float, partial: bool = False) -> RMSNorm:
        return RMSNorm(size, eps, self.norm_offset, self.norm_gain_float32, partial)


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 last: bool = True) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act, self.last = _ACTIVATIONS[activation], last

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Partial under TP, without down's bias (the block adds it once, after the sum). When it is the layer's
        last op (``last``: no norm after it), in a recompute its value is never read, so its forward matmul is
        skipped (:func:`ipuft.ops.output_projection`; the attention's output projection is read by the MLP's
        norm, so it is not)."""
        return self.down_proj.project(self.act(self.gate_proj(h)) * self.up_proj(h), bias=False,
                                      skip_in_recompute=self.last)


class LlamaDecoderBlock(nn.Module):
    """``hidden[B, T, H] -> hidden[B, T, H]`` for one layer (``cache``: this layer's KV cache, when generating).

    ``block`` says the family's arithmetic (:class:`BlockArithmetic`; the default is Llama's pre-norm block).
    A model whose layers differ (sliding and full layers, a local rotary) reads the layer it is called for from
    :func:`ipuft.attention.current_layer`."""

    def __init__(self, hidden_size: int, intermediate_size: int, heads: int, kv_heads: int, head_dim: int,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 qkv_bias: bool = False, output_bias: bool = False, dropout_prob: float = 0.0,
                 tensor_parallel: int = 1, block: BlockArithmetic | None = None, rotary_dim: int | None = None,
                 longest: int | None = None, fused_projections: bool = False) -> None:
        super().__init__()
        block = block or BlockArithmetic()
        self.block, self.norm_names = block, block.norms
        before_attn, after_attn, before_mlp, after_mlp = block.norms
        if before_attn:
            self.add_module(before_attn, block.norm(hidden_size, rms_norm_eps))
        extra = {}
        if block.qk_norm is not None:  # q/k norms: per head, or over the whole width (refused under TP)
            q_size, k_size = (head_dim, head_dim) if block.qk_norm == "head" else (heads * head_dim,
                                                                                 kv_heads * head_dim)
            extra.update(q_norm=block.norm(q_size, rms_norm_eps, partial=True),
                         k_norm=block.norm(k_size, rms_norm_eps, partial=True), qk_norm_width=block.qk_norm == "width")
        if block.query_pre_attn_scalar is not None:
            extra["scale"] = block.query_pre_attn_scalar**-0.5
        if block.attn_logit_softcap is not None:
            extra["logit_softcap"] = block.attn_logit_softcap
        # rotary_dim < head_dim: partial rotary (Phi-3's partial_rotary_factor); longest: which longrope factors
        rotary = HalvesRotary(head_dim, rotary_dim or head_dim, rope_theta, rope_scaling, longest)
        self.self_attn = CausalSelfAttention(hidden_size, heads, head_dim, rotary,
                                             kv_heads=kv_heads, tensor_parallel=tensor_parallel, qkv_bias=qkv_bias,
                                             output_bias=output_bias, output_name="o_proj", **extra)
        for name in (after_attn, before_mlp):
            if name:
                self.add_module(name, block.norm(hidden_size, rms_norm_eps))
        self.mlp = LlamaMLP(hidden_size, intermediate_size // tensor_parallel, block.activation, block.mlp_bias,
                            last=after_mlp is None)
        if after_mlp:
            self.add_module(after_mlp, block.norm(hidden_size, rms_norm_eps))
        self.local_rotary = None if block.local_rope_theta is None else HalvesRotary(
            head_dim, head_dim, block.local_rope_theta, None)
        self.dropout_prob = dropout_prob
        self.fused_projections = fused_projections
        # Every layer alike (Llama: no window; Mistral: the window on each): no need to know which layer runs.
        self.uniform = len(set(block.windows)) <= 1 and self.local_rotary is None

    def _layer_call(self, x: torch.Tensor) -> dict:
        """The attention's per-layer arguments: this layer's window and, on a sliding layer with a rotary of its
        own, that rotary. Measured without values and outside a layer (the plan's costs), it runs as a full
        layer, the costliest kind."""
        if self.uniform:
            return {"window": self.block.windows[0] if self.block.windows else None}
        layer = current_layer()
        if layer is None and not has_values(x):
            return {"window": None}
        if layer is None:
            raise RuntimeError("a Llama-architecture block whose layers differ (sliding and full attention) was "
                               "called outside a decoder layer's call (ipuft.attention.current_layer() is None)")
        window = self.block.windows[layer]
        if window is None:
            return {"window": None}
        return {"window": window, **({"rotary": self.local_rotary} if self.local_rotary is not None else {})}

    def _norm(self, index: int, x: torch.Tensor) -> torch.Tensor:
        name = self.norm_names[index]
        return x if name is None else getattr(self, name)(x)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        attn = reduce_from_tensor_parallel(self.self_attn(copy_to_tensor_parallel(self._norm(0, x)), cache,
                                                          **self._layer_call(x)))
        if self.self_attn.o_proj.bias is not None:
            attn = attn + self.self_attn.o_proj.bias
        h = x + F.dropout(self._norm(1, attn), self.dropout_prob, self.training)
        mlp = reduce_from_tensor_parallel(self.mlp(copy_to_tensor_parallel(self._norm(2, h))))
        if self.mlp.down_proj.bias is not None:
            mlp = mlp + self.mlp.down_proj.bias
        return h + F.dropout(self._norm(3, mlp), self.dropout_prob, self.training)

    @property
    def projections(self) -> dict[str, str]:
        """Each shared projection name (q k v o gate up down) and its module's path: what an adapter targets
        (``plugins.lora.targets``)."""
        return {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}

    def variable_specs(self) -> list[VariableSpec]:
        gain = Init("zeros") if self.block.norm_offset else Init("ones")  # 1 + w starts at w = 0
        inits = {name: Init("normal", 0.02) for name, _ in self.named_parameters()}
        inits.update({f"{name}.weight": gain for name, m in self.named_modules() if isinstance(m, RMSNorm)})
        inits.update({name: Init("zeros") for name, _ in self.named_parameters() if name.endswith(".bias")})
        return specs_from_module(self, inits)

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        return {name: f"model.layers.{layer}.{name}" for name, _ in self.named_parameters()}

    def hf_fused(self, layer: int | None) -> tuple:
        """Phi-3's fused q/k/v and gate/up tensors (:func:`ipuft_llama.phi3.fused_rows`), when it is one."""
        if not self.fused_projections:
            return ()
        from ipuft_llama.phi3 import fused_rows

        return fused_rows(layer)


class LlamaEmbeddings(TokenEmbeddings):
    """Core's token embeddings, times sqrt(hidden) with ``scale`` (Gemma: that factor rounded to the table's
    dtype first, as transformers computes it), and with ``padding_idx`` (config.json's ``pad_token_id``) that
    row's gradient always zero, as ``nn.Embedding(padding_idx=...)`` has it in transformers."""

    def __init__(self, *args, scale: bool = False, padding_idx: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale, self.padding_idx = scale, padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = getattr(self, self.table_name)
        hidden = vocab_parallel_embedding(table, input_ids, self.tensor_parallel)
        if self.padding_idx is not None:  # the pad row's lookups pass no gradient to it
            hidden = torch.where((input_ids == self.padding_idx)[..., None], hidden.detach(), hidden)
        if self.scale:
            hidden = hidden * torch.tensor(math.sqrt(table.weight.shape[1]), dtype=torch.float32).to(hidden.dtype)
        return F.dropout(hidden, self.dropout_prob, self.training)


class LlamaLMHead(nn.Module):
    """Final RMSNorm and a projection without bias (tied or not): ``hidden[B, T, H] -> logits[B, T, V]``, or the
    mean cross-entropy (float32) when ``labels[B, T]`` are given; under TP sharded by vocabulary; the logits
    soft-capped by ``softcap`` (Gemma 2's final_logit_softcapping) when given."""

    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float = 1e-6, tensor_parallel: int = 1,
                 tied: bool = False, norm_offset: bool = False, norm_gain_float32: bool = False,
                 softcap: float | None = None):
        super().__init__()
        self.norm = RMSNorm(hidden_size, rms_norm_eps, norm_offset, norm_gain_float32)
        self.softcap = softcap
        rows = VOCAB_SHARDED.local_shape((vocab_size, hidden_size), tensor_parallel)[0]
        self.lm_head = Linear(hidden_size, rows, bias=False)
        self.vocab_size, self.tensor_parallel, self.tied = vocab_size, tensor_parallel, tied

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return vocab_parallel_head(self.lm_head, self.norm(hidden), labels, self.vocab_size, self.tensor_parallel,
                                   IGNORE_INDEX, softcap=self.softcap)

    def variable_specs(self) -> list[VariableSpec]:
        gain = Init("zeros") if self.norm.offset else Init("ones")
        specs = specs_from_module(self, {"norm.weight": gain, "lm_head.weight": Init("normal", 0.02)})
        return tie(specs, "lm_head.weight", "embeddings.embed_tokens.weight") if self.tied else specs

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        tied = {} if self.tied else {"lm_head.weight": "lm_head.weight"}  # a tied model has no lm_head.weight
        return {"norm.weight": "model.norm.weight", **tied}
