"""Causal self-attention with rotary position embeddings, one module for every decoder family.

:class:`CausalSelfAttention` projects ``h[B, T, hidden]`` to queries, keys and values, rotates the first
``rotary_dim`` dimensions of each query and key head by its position, attends causally, and projects back.
What differs between families is a parameter:

- the rotation: :class:`InterleavedRotary` (GPT-J: each adjacent pair ``(x[2i], x[2i+1])`` turns) or
  :class:`HalvesRotary` (Llama, GPT-NeoX: dimension ``i`` pairs with ``i + rotary_dim / 2``), over the whole
  head or its first ``rotary_dim`` dimensions;
- biases on q, k, v and on the output projection, and that projection's name (``out_proj``, ``o_proj``), so
  that every family keeps its weights' names;
- grouped-query attention: ``kv_heads`` key/value heads, each read by ``heads / kv_heads`` query heads;
- the kernel: ``sdpa`` (``F.scaled_dot_product_attention``) or ``eager`` (matmul, softmax, matmul);
- the softmax ``scale`` (default ``head_dim ** -0.5``; Gemma's ``query_pre_attn_scalar ** -0.5``), Gemma 2's
  attention-logit soft-cap (``cap · tanh(scores / cap)`` before the mask, computed by the eager kernel), and
  RMSNorms of the queries and keys before rotary (``q_norm``, ``k_norm``: per head for Qwen3 and Gemma 3, over
  the whole projected width for OLMo 2, ``qk_norm_width``), each the family's module.

Per call, ``forward(h, cache, window=W, rotary=R)`` attends within a sliding window (query ``i`` sees keys
``i - W < j ≤ i``: transformers' ``sliding_window_overlay`` on its causal mask, the same for Mistral, Qwen2,
Gemma 2 and Gemma 3) and rotates by another rotary than the module's own (Gemma 3's local layers' base). A
block whose layers differ reads which layer it is from :func:`current_layer`, which the engine sets around
every decoder call (:func:`decoder_layer`).

**Tensor parallelism.** The module is built with the whole model's head counts and ``tensor_parallel``, and
holds this rank's ``heads / TP`` query heads and their key/value heads: q, k and v column-sharded, the output
projection row-sharded (its output partial, summed by the block's all-reduce, which then adds the output bias
once). When TP does not divide ``kv_heads``, the key/value projections are replicated instead: every rank
computes all key/value heads and reads those its query heads use; their gradients are partial on each rank
and summed over TP (:func:`ipuft.parallel.copy_to_tensor_parallel` on the weights). A q/k norm per head is
the same on every rank; one over the projected width would need its statistics summed over TP, and is refused
there (``ValueError``).

**16-bit on the CPU.** A training attention (no cache) on 16-bit activations computes its rotary and attention
in float32 where ATen's 16-bit CPU kernel is the slower (:func:`ipuft.ops.attention_in_float32`), and casts
its output back before the output projection. A cache keeps its dtype.

**Packed examples.** Within :func:`examples_apart` (the engine sets it around each micro-batch's module call
when its batch has positions), an attention without a cache reads each token's position within its example
from ``positions[B, T]``: the rotary turns each token by its own position (``Rotary.at``), and a query sees
only the keys of its own example, up to itself (:func:`example_mask`), so that several examples packed in one
row attend as if each had a row of its own. A window is then the band ``i - W < j`` on top: the examples are
consecutive tokens, so a distance in the row is a distance in the example.

**Generation.** ``forward(h, cache)`` takes an optional per-layer key/value cache
(:class:`ipuft.generate.LayerKVCache`): the new tokens' positions start at ``cache.length``, their keys (after
rotary, ``kv_heads`` wide) and values are appended to it, and the queries attend over every cached and new
key. A batch of rows of different lengths is left-padded: the cache then carries each row's padding, which
sets the row's positions (its first real token is position 0) and hides its pad keys from every query. With
a window the cache keeps only the last ``W`` keys and values, all a next query can see.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.ops import Linear, attention_in_float32
from ipuft.parallel import copy_to_tensor_parallel, tensor_parallel_rank

if TYPE_CHECKING:
    from ipuft.generate import LayerKVCache

KERNELS = ("sdpa", "eager")
_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("ipuft_positions", default=None)
_LAYER: contextvars.ContextVar[int | None] = contextvars.ContextVar("ipuft_layer", default=None)


@contextmanager
def decoder_layer(layer: int | None) -> Iterator[None]:
    """Within the block, :func:`current_layer` is ``layer`` (0-based; ``None``: no decoder layer).

    This is the one setter of the layer context, and it changes arithmetic: a block whose layers differ (a
    sliding window on some, another rotary base on others: Gemma 2 and 3, Qwen2's ``max_window_layers``) is one
    module shared by every layer, and reads here which layer it runs as. The engine sets it around each decoder
    layer's module call: its forward, its recompute and its kept graph in training
    (:meth:`ipuft.engine.compute.UnitCompute.call`), eval, scoring and every generation pass
    (:class:`ipuft.engine.inference.LayerMajor`), and the plan's measurement of each layer kind
    (:mod:`ipuft.plan.measure`); the embeddings and the head run outside any (``None``)."""
    token = _LAYER.set(layer)
    try:
        yield
    finally:
        _LAYER.reset(token)


def current_layer() -> int | None:
    """The decoder layer (0-based) whose module call is running now, ``None`` outside one
    (:func:`decoder_layer`)."""
    return _LAYER.get()


@contextmanager
def examples_apart(positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, every :class:`CausalSelfAttention` called without a cache takes ``positions[B, T]``
    (int64, on the compute device: each token's position within its example, 0 where an example starts) for
    its rows' positions, and attends within each example. ``None``: one example per row, as outside the block.
    The engine sets it around each micro-batch's module call: its forward and the recompute of its backward
    see the same tensor."""
    token = _POSITIONS.set(positions)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


def packed_positions() -> torch.Tensor | None:
    """The positions :func:`examples_apart` set for the module call running now (``None``: one example per row):
    what a decoder with an attention of its own reads to keep packed examples apart (with :func:`example_mask`)."""
    return _POSITIONS.get()


def example_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query ``i`` sees key ``j`` iff ``j ≤ i`` and ``j`` is in ``i``'s example, whose
    first token is ``i - positions[i]`` (block-diagonal causal; the examples are consecutive tokens)."""
    # In int32, and the second comparison into the first's result: 13× faster here than int64 and `&` (T = 1024).
    i = torch.arange(positions.shape[-1], dtype=torch.int32, device=positions.device)
    first = (i - positions.to(torch.int32))[..., None]  # [B, T, 1]: each query's example's first token
    return (i >= first).logical_and_(i <= i[:, None])[:, None]


def window_mask(positions: int, window: int, device: torch.device) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` iff ``i - window < j ≤ i`` (a sliding window on the causal
    mask, as transformers' ``sliding_window_causal_mask_function``)."""
    i = torch.arange(positions, device=device)
    distance = i[:, None] - i  # query minus key
    return (distance >= 0).logical_and_(distance < window)


def inverse_frequencies(rotary_dim: int, base: float, scaling: dict | None = None,
                        longest: int | None = None) -> torch.Tensor:
    """``base^(-2i/rotary_dim)`` for each pair ``i`` (float32, on the CPU), scaled as ``scaling`` says:
    ``linear`` divides every frequency by ``factor``; ``llama3`` divides the low frequencies (wavelengths past
    the original context over ``low_freq_factor``) by ``factor``, keeps the high ones, and blends in between;
    ``longrope`` (Phi-3) divides pair ``i``'s by ``short_factor[i]``, or by ``long_factor[i]`` when the longest
    sequence the model runs (``longest``) exceeds ``original_max_position_embeddings`` (see
    :func:`longrope_is_long`)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        key = "long_factor" if longrope_is_long(scaling, longest) else "short_factor"
        return 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * base**exponents)
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


def longrope_is_long(scaling: dict, longest: int | None) -> bool:
    """Whether ``longrope`` turns by its long factors: when ``longest``, the longest sequence the model runs
    (``model.sequence_length``, which also bounds generation), exceeds ``original_max_position_embeddings``.

    transformers chooses per forward call, by the call's last position (long past the original context, for
    every position of the call) and, generating, recomputes the whole sequence once it crosses. ipuft chooses
    once per run, so that training, eval and a generation's cached keys all turn alike: a row as long as the
    run's sequences is turned as transformers turns it; shorter calls of a run longer than the original
    context (a short prompt's first tokens) turn by the long factors where transformers would use the short."""
    return longest is not None and longest > scaling["original_max_position_embeddings"]


def rotary_attention_factor(scaling: dict | None) -> float:
    """What ``scaling`` multiplies the rotary cos and sin by: ``longrope``'s ``attention_factor``, else 1."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    return float(scaling["attention_factor"])


def rotary_angles(positions: int, rotary_dim: int, base: float, scaling: dict | None,
                  device: torch.device) -> torch.Tensor:
    """``[positions, rotary_dim / 2]`` float32: position ``p``'s angle for pair ``i``, ``p`` times its frequency."""
    inv = inverse_frequencies(rotary_dim, base, scaling).to(device)
    return torch.outer(torch.arange(positions, device=device).float(), inv)


def rotary_rotor(positions: int, rotary_dim: int, head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """Unit complex numbers ``[positions, 1, head_dim // 2]``: pair ``i`` of a head turns by
    ``position · base^(-2i/rotary_dim)`` when ``i < rotary_dim / 2``, and by angle 0 (times exactly 1)
    past it, so that one contiguous complex multiply covers every pair of a head."""
    angles = F.pad(rotary_angles(positions, rotary_dim, base, None, device), (0, head_dim // 2 - rotary_dim // 2))
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x[d/2:], x[:d/2])`` along the last dimension ``d``: the rotation's sine partner of each dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Rotary(Protocol):
    """A rotary position embedding, as :class:`CausalSelfAttention` uses one: a table of every position below a
    size, the rows of some positions taken from it, and the rotation of a query or key by those rows. ``Rows``
    is whatever the rotation reads (a tensor, a pair of tensors)."""

    def table(self, size: int, device: torch.device) -> Any:
        """The rows of positions ``0 … size - 1``."""

    def span(self, table: Any, start: int, length: int) -> Any:
        """The rows of positions ``start … start + length - 1`` of ``table``, the same for every batch row."""

    def at(self, table: Any, positions: torch.Tensor) -> Any:
        """The rows of ``positions[B, T]`` (each batch row its own), from ``table``."""

    def rotate(self, x: torch.Tensor, rows: Any) -> torch.Tensor:
        """``x[B, T, heads, head_dim]`` rotated by ``rows``, as ``[B, heads, T, head_dim]``."""


@dataclass(frozen=True)
class InterleavedRotary:
    """GPT-J's rotary: each adjacent pair ``(x[2i], x[2i+1])`` of the first ``rotary_dim`` dimensions turns by
    ``position · base^(-2i/rotary_dim)``; the rows are unit complex numbers (:func:`rotary_rotor`), and the
    rotation one complex multiply, in float32, before the heads are transposed."""

    head_dim: int
    rotary_dim: int
    base: float = 10000.0

    def table(self, size: int, device: torch.device) -> torch.Tensor:
        return rotary_rotor(size, self.rotary_dim, self.head_dim, self.base, device)  # [size, 1, head_dim / 2]

    def span(self, table: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return table[start : start + length]  # [T, 1, head_dim / 2]

    def at(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions]  # [B, T, 1, head_dim / 2]

    def rotate(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return apply_interleaved_rotary(x, rows).transpose(1, 2)


@dataclass(frozen=True)
class HalvesRotary:
    """Llama's and GPT-NeoX's rotary ("rotate_half"): dimension ``i`` of the first ``rotary_dim`` pairs with
    ``i + rotary_dim / 2`` and turns by ``position · base^(-2i/rotary_dim)`` (frequencies scaled by
    ``scaling``, see :func:`inverse_frequencies`; longrope's cos and sin also by its ``attention_factor``, and
    its factors chosen by ``longest``); the rows are float32 cos and sin, each frequency twice, cast
    to the activations' dtype, and the rotation is computed in that dtype after the heads are transposed, as
    transformers does."""

    head_dim: int
    rotary_dim: int
    base: float = 10000.0
    scaling: dict | None = None
    longest: int | None = None  # the longest sequence the model runs: which longrope factors apply

    def table(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = inverse_frequencies(self.rotary_dim, self.base, self.scaling, self.longest).to(device)
        angles = torch.outer(torch.arange(size, device=device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        factor = rotary_attention_factor(self.scaling)
        if factor == 1.0:
            return angles.cos(), angles.sin()  # each [size, rotary_dim]
        return angles.cos() * factor, angles.sin() * factor  # longrope's attention factor, in float32

    def span(self, table: tuple[torch.Tensor, torch.Tensor], start: int,
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = table
        return cos[start : start + length], sin[start : start + length]  # [T, rotary_dim]

    def at(self, table: tuple[torch.Tensor, torch.Tensor],
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = table
        return cos[positions][:, None], sin[positions][:, None]  # [B, 1, T, rotary_dim]

    def rotate(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x.transpose(1, 2)
        cos, sin = (t.to(x.dtype) for t in rows)
        if self.rotary_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        turned, kept = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


class CausalSelfAttention(nn.Module):
    """``h[B, T, hidden] -> [B, T, hidden]``: this rank's heads' attention, its output projection's result
    partial under TP and without the output bias (the block adds it once, after the all-reduce).

    ``heads`` and ``kv_heads`` (default ``heads``) are the whole model's; ``rotary`` one of
    :class:`InterleavedRotary` and :class:`HalvesRotary`; ``output_name`` the output projection's attribute
    (and so its weights' names). ``skip_output_in_recompute``: the output is read by nothing but the layer's
    output (GPT-J's parallel block), so while the engine recomputes the layer for its gradient the output
    projection's forward matmul is skipped (:func:`ipuft.ops.output_projection`).

    ``scale``: the softmax scale (``None``: ``head_dim ** -0.5``). ``logit_softcap``: scores become
    ``cap · tanh(scores / cap)`` before the mask (Gemma 2); it needs the scores, so the kernel is then eager.
    ``q_norm``, ``k_norm``: the family's norms of the queries and keys before rotary, registered as
    ``q_norm`` / ``k_norm`` (transformers' names); over each head's ``head_dim``, or with ``qk_norm_width``
    over the whole projected width (``heads · head_dim`` and ``kv_heads · head_dim``, OLMo 2), which
    tensor parallelism would cut: refused there (``ValueError``).
    """

    def __init__(self, hidden_size: int, heads: int, head_dim: int, rotary: Rotary, *, kv_heads: int | None = None,
                 tensor_parallel: int = 1, qkv_bias: bool = False, output_bias: bool = False,
                 output_name: str = "o_proj", kernel: str = "sdpa", skip_output_in_recompute: bool = False,
                 scale: float | None = None, logit_softcap: float | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None, qk_norm_width: bool = False) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel {kernel!r}: one of {', '.join(KERNELS)}")
        if qk_norm_width and tensor_parallel > 1 and (q_norm is not None or k_norm is not None):
            raise ValueError(f"a q/k norm over the whole projected width needs its statistics over every head, "
                             f"which tensor_parallel={tensor_parallel} splits; run it with tensor_parallel=1")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"attention logit soft-cap must be > 0, got {logit_softcap}")
        kv_heads = heads if kv_heads is None else kv_heads
        self.heads = heads // tensor_parallel  # this rank's query heads
        self.group = heads // kv_heads  # query heads per key/value head
        self.kv_replicated = kv_heads % tensor_parallel != 0
        self.kv_heads = kv_heads if self.kv_replicated else kv_heads // tensor_parallel
        self.head_dim, self.tensor_parallel = head_dim, tensor_parallel
        self.q_proj = Linear(hidden_size, self.heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, self.kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, self.kv_heads * head_dim, bias=qkv_bias)
        self.output_name = output_name
        self.add_module(output_name, Linear(self.heads * head_dim, hidden_size, bias=output_bias))
        self.q_norm, self.k_norm, self.qk_norm_width = q_norm, k_norm, qk_norm_width
        self.scale, self.logit_softcap = scale, logit_softcap
        # The soft-cap is applied to the scores themselves: only the eager kernel has them.
        kernel = "eager" if logit_softcap is not None else kernel
        self.rotary, self.kernel, self.skip_output_in_recompute = rotary, kernel, skip_output_in_recompute
        self._tables: dict[tuple, tuple[Rotary, Any]] = {}

    @property
    def output(self) -> nn.Linear:
        """The output projection (``out_proj``, ``o_proj``: the name the family's weights have)."""
        return getattr(self, self.output_name)

    def _table(self, rotary: Rotary, size: int, device: torch.device) -> Any:
        # By the rotary's identity (a rotary with a scaling dict is not hashable); the entry keeps it alive.
        key = (id(rotary), size, device)
        if key not in self._tables:
            self._tables[key] = (rotary, rotary.table(size, device))
        return self._tables[key][1]

    def _rotor(self, rotary: Rotary, start: int, length: int, device: torch.device) -> Any:
        """The rotary rows of positions ``start … start + length - 1``.

        Without a cache (``start`` 0) there is one small table per sequence length and device. A cached
        step slices a table whose length is the next power of two, so that decoding makes few tables.
        """
        size = length if start == 0 else 1 << (start + length - 1).bit_length()
        return rotary.span(self._table(rotary, size, device), start, length)

    def _positions(self, new: int, cache: LayerKVCache | None, device: torch.device, rotary: Rotary,
                   window: int | None) -> tuple[Any, torch.Tensor | None]:
        """The rotary rows of the next ``new`` tokens, and the mask of the keys they may see (``None``: causal
        over every key given, the last ``new`` of them the queries')."""
        packed = packed_positions() if cache is None else None
        if packed is not None:  # packed examples (examples_apart): each token's own position, each example apart
            if packed.shape[-1] != new:
                raise ValueError(f"examples_apart: positions of {packed.shape[-1]} tokens for {new}")
            mask = example_mask(packed)
            if window is not None and new > window:
                mask = mask.logical_and_(window_mask(new, window, device))
            return rotary.at(self._table(rotary, new, device), packed), mask
        if cache is None:
            mask = window_mask(new, window, device) if window is not None and new > window else None
            return self._rotor(rotary, 0, new, device), mask
        mask = cache.attention_mask(new, device, window) if cache.masks(new, window) else None
        if cache.pad is None:
            return self._rotor(rotary, cache.length, new, device), mask
        # Left-padded rows: per-row positions from a table that covers every position, and pad keys hidden.
        table = self._table(rotary, 1 << (cache.length + new - 1).bit_length(), device)
        return rotary.at(table, cache.positions(new, device)), mask

    def _kv_projection(self, proj: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        if not (self.kv_replicated and self.tensor_parallel > 1):
            return proj(h)
        # Every rank holds the whole projection and reads only its query heads' share: its gradient is partial
        # here, and summed over TP by the backward of the copy.
        bias = None if proj.bias is None else copy_to_tensor_parallel(proj.bias)
        out = F.linear(h, copy_to_tensor_parallel(proj.weight), bias)
        return out if proj.adapter is None else out + proj.adapter(proj, h)  # its adapter sums its own

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

    def _normed(self, norm: nn.Module | None, x: torch.Tensor, heads: int) -> torch.Tensor:
        """A projection's output ``[B, T, heads · head_dim]`` as ``[B, T, heads, head_dim]``, through ``norm``
        (over the width, or per head) when there is one."""
        if norm is not None and self.qk_norm_width:
            x = norm(x)
        x = x.unflatten(-1, (heads, self.head_dim))
        return x if norm is None or self.qk_norm_width else norm(x)

    def forward(self, h: torch.Tensor, cache: LayerKVCache | None = None, *, window: int | None = None,
                rotary: Rotary | None = None) -> torch.Tensor:
        """``h[B, T, hidden]``'s attention, continuing ``cache``'s positions when given. ``window``: each
        query sees the keys of its last ``window`` positions, itself included (``None``: every earlier one);
        ``rotary``: this call's rotary instead of the module's (its tables cached per rotary)."""
        if window is not None and not window > 0:
            raise ValueError(f"attention window must be a positive number of positions, got {window}")
        rotary = self.rotary if rotary is None else rotary
        new = h.shape[1]
        rows, mask = self._positions(new, cache, h.device, rotary, window)
        q = self._normed(self.q_norm, self.q_proj(h), self.heads)  # [B, T, heads, head_dim]
        k = self._normed(self.k_norm, self._kv_projection(self.k_proj, h), self.kv_heads)
        v = self._kv_projection(self.v_proj, h).unflatten(-1, (self.kv_heads, self.head_dim))
        if cache is None and self.kernel == "sdpa" and attention_in_float32(h, self.head_dim, new):
            # Where ATen's 16-bit CPU flash attention is the slower (ipuft.ops.attention_in_float32): the rotary
            # and the attention stay in float32 up to the output projection. A cache keeps its dtype.
            q, k, v = q.float(), k.float(), v.float()
        q, k = rotary.rotate(q, rows), rotary.rotate(k, rows)  # [B, heads, T, head_dim]
        v = v.transpose(1, 2)
        if cache is not None:
            # The keys and values the new queries may see, kv_heads wide: [B, kv, T_seen + T, head_dim].
            k, v = cache.append(k, v, window)
        k, v = self._local_kv(k, v)
        out = self._attend(q, k, v, mask).to(h.dtype).transpose(1, 2).flatten(-2)
        # The bias, if any, is the block's to add once, after the tensor-parallel sum.
        return self.output.project(out, bias=False, skip_in_recompute=self.skip_output_in_recompute)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of the last ``T_q`` positions over all ``T_k``: query i sees keys ≤ T_k - T_q + i
        (and of those only the ones ``mask[B, 1, T_q, T_k]`` allows, when given)."""
        t_q, t_k = q.shape[-2], k.shape[-2]
        if self.kernel == "eager":
            if mask is None:
                mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
            scores = q @ k.transpose(-1, -2)
            scores = scores / math.sqrt(self.head_dim) if self.scale is None else scores * self.scale
            if self.logit_softcap is not None:
                scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
            return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1) @ v
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        if t_q == t_k:  # no past: the plain causal mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        if t_q == 1:  # one new token sees everything
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=self.scale)
