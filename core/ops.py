"""Building blocks for component modules (this module imports torch; plugins import it from their modules, not
from their hooks).

- :func:`linear`: ``F.linear`` whose weight gradient the engine may take later, for all of a unit's
  micro-batches at once (:class:`WeightGradients`); :class:`Linear`, an ``nn.Linear`` that computes by it. A
  component should use them for its projections (one that does not is still correct, only slower).
- :func:`embedding`: ``F.embedding`` whose weight gradient the engine takes later the same way (the rows the
  micro-batches' tokens touch, added into a zeroed gradient); :class:`Embedding`, an ``nn.Embedding`` by it.
- :func:`output_projection`: a :func:`linear` that, while the engine recomputes a layer only for its gradient
  (:func:`ipuft.components.recomputing`), skips the forward matmul whose value nobody reads.
- :func:`attention_in_float32`: whether a 16-bit attention on this CPU is faster computed in float32.

**Weight gradients taken later.** Batch serialisation runs every micro-batch through a unit before the next
unit, and sums the unit's gradient over them. Autograd makes each micro-batch's weight gradient ``gᵀ·x`` as
a matmul whose inner dimension is the micro-batch's tokens (256 at GPT-J's sequence length and micro-batch
1) into a fresh tensor the size of the weight, which the engine then adds to the sum so far. At GPT-J-6B's
width on a CPU with AMX those matmuls ran at half the rate of the forward's, most of it in faulting in the
fresh gradient, and the float32 sums of 16-bit gradients were another two passes over every weight. While the
engine runs a unit's micro-batches inside :func:`taking_weight_gradients`, :func:`linear` keeps each
micro-batch's ``x`` and ``g`` for the weights the engine named instead, and the engine takes their gradients
(:meth:`WeightGradients.take`) as one matmul over all of those micro-batches' tokens: the same sum, computed
in the matmul's float32 accumulator and rounded once, with one output tensor. What it costs is holding ``x``
and ``g`` of every projection for those micro-batches (14·hidden values a token for GPT-J), which the engine
bounds (:func:`ipuft.engine.cuts.take_every`) and the plan counts.

An embedding's gradient is the same story with a scatter for the matmul: autograd makes each micro-batch's
as a fresh dense table of zeros with the micro-batch's rows added in ([50400, 4096] at GPT-J-6B's width,
nearly all of its time faulting in and zeroing the table), then the engine sums the tables.
:func:`embedding` keeps each micro-batch's ids and output gradient instead, and the take adds them all into
one zeroed table (the unit's stored gradient, where the engine gives it). A 16-bit table's rows are added
into one float32 sum over all of the step's micro-batches as they come (:meth:`WeightGradients.accumulator`),
rounded once at the unit's last take: no 16-bit table per take beside the float32 sum (Llama-3's is 1 GiB).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ipuft.components import recomputing

Pieces = list[tuple[torch.Tensor, torch.Tensor]]


class WeightGradients:
    """The ``(x, g)`` pairs of :func:`linear` calls whose weight (and bias) gradients are taken later, for the
    weight and bias leaves it was made with; the engine makes one for a unit's backward."""

    def __init__(self, leaves: Iterable[torch.Tensor], moves: SliceMoves | None = None) -> None:
        """``moves``: where a gradient made slice by slice (:meth:`deferred`) keeps its inputs and puts its
        slices (default: where they are)."""
        self._leaves = {id(t) for t in leaves}
        self._pieces: dict[int, tuple[torch.Tensor, torch.Tensor | object | None, Pieces]] = {}
        # Float32 sums some ops add their gradients into as they go (a chunked head's, ipuft.head_loss), or
        # gradients they make at the last take (deferred), kept over the unit's micro-batches until then, and the
        # factors to scale them by.
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor | Deferred, list[torch.Tensor]]] = {}
        self.moves = moves or SliceMoves()
        self.homed: list[torch.Tensor] = []  # the leaves whose deferred gradients moves put away themselves

    def accumulator(self, leaf: torch.Tensor) -> torch.Tensor:
        """A float32 sum of ``leaf``'s shape for an op to add its unscaled gradients into, over every micro-batch
        until the last :meth:`take` (zeros at first); the op records its upstream factor with :meth:`scale`."""
        if id(leaf) not in self._sums:
            self._sums[id(leaf)] = (leaf, torch.zeros(leaf.shape, dtype=torch.float32, device=leaf.device), [])
        return self._sums[id(leaf)][1]

    def deferred(self, leaf: torch.Tensor, make: Callable[[], Deferred]) -> Deferred:
        """The :class:`Deferred` gradient of ``leaf`` over every micro-batch until the last :meth:`take` (``make``
        makes it at the first call), to which an op adds what it needs; its upstream factor recorded with
        :meth:`scale`."""
        if id(leaf) not in self._sums:
            self._sums[id(leaf)] = (leaf, make(), [])
        return self._sums[id(leaf)][1]

    def scale(self, leaf: torch.Tensor, factor: torch.Tensor) -> None:
        """One micro-batch's upstream factor for :meth:`accumulator`'s sum of ``leaf`` (the sum is scaled by it
        at the last take: every micro-batch of a unit must have the same, as the engine's seeds do)."""
        self._sums[id(leaf)][2].append(factor)

    def accumulated(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(leaf, float32 sum)`` of every :meth:`accumulator` so far (not the :meth:`deferred` gradients)."""
        return [(leaf, total) for leaf, total, _ in self._sums.values() if isinstance(total, torch.Tensor)]

    def deferred_held(self) -> list[torch.Tensor]:
        """What the :meth:`deferred` gradients hold so far where they compute (for the ledger)."""
        return [t for _, total, _ in self._sums.values() if not isinstance(total, torch.Tensor) for t in total.held()]

    def takes(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the gradients of ``weight`` (and of ``bias``, when trainable) are taken here."""
        return id(weight) in self._leaves and (bias is None or not bias.requires_grad or id(bias) in self._leaves)

    def add(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, g: torch.Tensor) -> None:
        """Keep one call's input ``x[..., in]`` and output gradient ``g[..., out]``."""
        kept = bias if bias is not None and bias.requires_grad else None
        # Detached: a kept input must not keep the autograd graph that made it.
        self._keep(weight, kept, x.detach().reshape(-1, x.shape[-1]), g)

    def add_rows(self, weight: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        """Keep one embedding lookup's ``ids`` and the gradient ``g[..., dim]`` of the rows it looked up."""
        self._keep(weight, ROWS, ids.reshape(-1), g)

    def _keep(self, weight: torch.Tensor, kind: torch.Tensor | object | None, x: torch.Tensor, g: torch.Tensor) -> None:
        """``kind``: the trainable bias taken with ``weight``, None, or :data:`ROWS` for an embedding."""
        self._pieces.setdefault(id(weight), (weight, kind, []))[2].append((x, g.detach().reshape(-1, g.shape[-1])))

    def held(self) -> list[torch.Tensor]:
        """The tensors kept so far (for the plan's measurement of what they hold)."""
        return [t for _, _, pieces in self._pieces.values() for pair in pieces for t in pair]

    def take(self, into: Callable[[torch.Tensor], torch.Tensor | None] | None = None, final: bool = True
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(leaf, gradient)`` for every weight and bias seen since the last take, each the sum over every
        kept call (``gᵀ·x`` over all their tokens, one matmul; the bias's ``Σ g``), in the leaf's dtype. The
        kept tensors are let go weight by weight. With ``final`` (the unit's last take), also the
        :meth:`accumulator` sums, scaled, in float32 whatever the leaf's dtype.

        ``into(leaf)`` may give a tensor to write the gradient into (of its shape and dtype, contiguous): memory
        the caller no longer needs, which, unlike a fresh tensor, a CPU does not fault in page by page."""
        def home(leaf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
            out = into(leaf) if into is not None else None
            fits = out is not None and out.shape == leaf.shape and out.dtype == dtype and out.is_contiguous()
            return out if fits else None

        while self._pieces:
            _, (weight, bias, pieces) = self._pieces.popitem()
            xs, gs = zip(*pieces)
            pieces.clear()
            if bias is not ROWS and len(xs) > 1 and all(t.dtype == torch.float32 for t in (*xs, *gs)):
                yield from _summed_takes(weight, bias, xs, gs, home)
                continue
            x, g = (torch.cat(ts) if len(ts) > 1 else ts[0] for ts in (xs, gs))
            del xs, gs
            if bias is ROWS:
                yield weight, _rows_gradient(weight, x, g, home(weight, weight.dtype))
                continue
            yield weight, torch.mm(g.t(), x, out=home(weight, torch.promote_types(g.dtype, x.dtype)))
            if bias is not None:
                yield bias, torch.sum(g, 0, out=home(bias, g.dtype))
        while final and self._sums:
            _, (leaf, total, factors) = self._sums.popitem()
            factor = _common_factor(factors)
            if not isinstance(total, torch.Tensor):  # made now, slice by slice, each scaled by the factor
                total = total.gradient(leaf, self.moves, factor)
                if total is None:  # the moves put the slices where the gradient is kept
                    self.homed.append(leaf)
                    continue
            elif factor is not None:
                total.mul_(factor)
            yield leaf, total


def _summed_takes(weight: torch.Tensor, bias: torch.Tensor | None, xs: tuple[torch.Tensor, ...],
                  gs: tuple[torch.Tensor, ...], home: Callable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A float32 weight's (and bias's) gradient over several kept calls as one product per call added into one
    float32 output (``addmm_``), instead of one product over their inputs concatenated: the same sum in float32,
    without copying every call's input and output gradient into fresh memory first (on a CPU that copy, faulted
    in page by page, cost SmolLM2-135M's step more than its weight-gradient products' own time). 16-bit takes
    keep the one product: its float32 accumulator rounded once."""
    out = torch.mm(gs[0].t(), xs[0], out=home(weight, torch.float32))
    for x, g in zip(xs[1:], gs[1:], strict=True):
        out.addmm_(g.t(), x)
    yield weight, out
    if bias is not None:
        total = torch.sum(gs[0], 0, out=home(bias, torch.float32))
        for g in gs[1:]:
            total.add_(g.sum(0))
        yield bias, total


def _common_factor(factors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one upstream factor every micro-batch recorded (None: none to apply, 1, or fake tensors in the plan's
    measurement, which have no values to check)."""
    if not factors or is_fake(factors[0]):
        return None
    factor = factors[0]
    stacked = torch.stack(factors)  # (all NaN alike: a step without a trained token, skipped)
    if not bool((stacked.eq(factor) | (stacked.isnan() & factor.isnan())).all()):
        raise RuntimeError("a gradient summed over micro-batches had different upstream factors")
    return None if float(factor) == 1.0 else factor


class Deferred:
    """A weight's gradient an op makes at the unit's last take rather than as it goes (a head's, one vocabulary
    slice at a time: :mod:`ipuft.head_loss`)."""

    def held(self) -> list[torch.Tensor]:
        """The tensors it holds where it computes until it is made."""
        raise NotImplementedError

    def gradient(self, leaf: torch.Tensor, moves: SliceMoves, factor: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient of ``leaf`` scaled by ``factor`` (float32), or None where ``moves`` put it away."""
        raise NotImplementedError


class SliceMoves:
    """Where a gradient made slice by slice keeps the inputs it needs between the micro-batches and puts its
    slices. This default keeps them where they are and puts the slices into a float32 gradient it returns; the
    engine's (:class:`ipuft.engine.sliced.StoredSlices`) keeps the inputs in host memory and writes each
    finished slice into the stored gradient, so that the whole gradient is never on the device."""

    def stash(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (one micro-batch's input) kept until the gradient is made."""
        return t

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A stashed tensor where the gradient is computed (:meth:`done` with it after)."""
        return t

    def done(self, t: torch.Tensor) -> None:
        """A fetched tensor is no longer used."""

    def output(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """Where the slices go: a float32 tensor of ``leaf``'s shape, or None where :meth:`put` keeps them."""
        return torch.zeros(leaf.shape, dtype=torch.float32, device=leaf.device)

    def put(self, leaf: torch.Tensor, out: torch.Tensor | None, start: int, grad: torch.Tensor) -> None:
        """Rows ``start …`` of ``leaf``'s gradient are ``grad`` (float32, scaled)."""
        out[start : start + grad.shape[0]] = grad

    def hold(self, n: int) -> None:
        """``n`` bytes of working tensors made where the gradient is computed (negative: freed)."""

    def rows_home(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A float32 gradient an embedding's looked-up rows are added into where it lies (:meth:`add_rows`),
        instead of a gradient made afresh: none by default."""
        return None

    def add_rows(self, weight: torch.Tensor, home: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        """Add the gradients ``g`` of the rows ``ids`` looked up into ``home``, in float32 (unrounded: the sum
        over the step is rounded once, as a 16-bit table's :meth:`accumulator` is)."""
        home.index_add_(0, ids, g.float())


ROWS = object()  # what WeightGradients keeps for an embedding where a projection keeps its bias: ``x`` holds ids


def _rows_gradient(weight: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An embedding's gradient, of ``weight``'s shape and dtype (into ``out`` when given): zeros, but for the rows
    ``ids`` looked up, each the sum of the gradients ``g[i]`` of its lookups. Float32 adds them in; a 16-bit table
    has the touched rows summed in a float32 scratch and each rounded once."""
    out = torch.zeros_like(weight, memory_format=torch.contiguous_format) if out is None else out.zero_()
    if out.dtype == torch.float32:
        return out.index_add_(0, ids, g.float())
    # Tokens sorted by row (stably: each row's in token order), numbered by group of equal rows: static shapes
    # throughout (the plan runs this on fake tensors), every group summed in its own float32 row.
    ids, order = torch.sort(ids, stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    torch.ne(ids[1:], ids[:-1], out=first[1:])
    group = first.cumsum(0).sub_(1)
    sums = torch.zeros(ids.numel(), g.shape[-1], dtype=torch.float32, device=g.device)
    sums.index_add_(0, group, g[order].float())
    return out.index_copy_(0, ids, sums[group].to(out.dtype))  # a row's tokens all write its one sum


_TAKING: contextvars.ContextVar[WeightGradients | None] = contextvars.ContextVar("ipuft_weight_gradients",
                                                                                 default=None)


@contextlib.contextmanager
def taking_weight_gradients(gradients: WeightGradients | None) -> Iterator[WeightGradients | None]:
    """Forwards with gradient inside the block keep the weight gradients of ``gradients``' leaves there (used
    by the engine; ``None``: autograd makes every gradient)."""
    token = _TAKING.set(gradients)
    try:
        yield gradients
    finally:
        _TAKING.reset(token)


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` whose weight and bias gradients go to ``taken`` (a :class:`WeightGradients`),
    and whose forward value, when ``value`` is false, is never read: it returns zeros, and its backward is
    exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                taken: WeightGradients | None, value: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.taken = taken
        ctx.leaves = (weight, bias) if taken is not None else None  # themselves: taken by identity
        if value:
            return F.linear(x, weight, bias)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.taken is not None:
            ctx.taken.add(*ctx.leaves, x, grad)
        else:
            flat = grad.reshape(-1, grad.shape[-1])
            grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
            grad_b = flat.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def taking(weight: torch.Tensor, bias: torch.Tensor | None) -> WeightGradients | None:
    """Where this call's weight (and bias) gradients go, if they are taken later (the engine's, in a unit's
    backward; also for :mod:`ipuft.head_loss`)."""
    taken = _TAKING.get()
    return taken if taken is not None and torch.is_grad_enabled() and taken.takes(weight, bias) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; in a unit's backward, its weight's gradient may be taken later, with its
    other micro-batches' (see the module docstring). Any other use is ``F.linear`` itself."""
    taken = taking(weight, bias)
    if taken is not None:
        return _Linear.apply(x, weight, bias, taken, True)
    return F.linear(x, weight, bias)


Adapter = Callable[["Linear", torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` computing by :func:`linear`, with an optional ``adapter``.

    ``adapter(module, x)``, when an adapter plugin sets one (LoRA, ``ipuft_lora``), is added to every output
    of the projection, however the component calls it: ``forward``, or :meth:`project` for an output
    projection that leaves out its bias or skips its matmul in a recompute. It reads its own parameters from
    ``module`` (registered there, so that they are the component's variables and the engine binds them)."""

    adapter: Adapter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

    def project(self, x: torch.Tensor, *, bias: bool = True, skip_in_recompute: bool = False) -> torch.Tensor:
        """``x @ weight.T`` (``+ bias`` unless ``bias`` is false) plus the adapter's output; with
        ``skip_in_recompute``, the projection is an :func:`output_projection` (a layer's last, its value unread
        in a recompute)."""
        if skip_in_recompute:
            y = output_projection(self.weight, x)
            y = y if not bias or self.bias is None else y + self.bias
        else:
            y = linear(x, self.weight, self.bias if bias else None)
        return y if self.adapter is None else y + self.adapter(self, x)


class _Embedding(torch.autograd.Function):
    """``weight[ids]`` whose weight gradient goes to ``taken`` (a :class:`WeightGradients`)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, taken: WeightGradients) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.taken, ctx.leaf = taken, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        home = ctx.taken.moves.rows_home(ctx.leaf)
        if home is not None:  # a gradient that lies elsewhere (a tied table's, in host memory): added in there
            ctx.taken.moves.add_rows(ctx.leaf, home, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
            if not any(leaf is ctx.leaf for leaf in ctx.taken.homed):
                ctx.taken.homed.append(ctx.leaf)
        elif ctx.leaf.dtype == torch.float32:
            ctx.taken.add_rows(ctx.leaf, ids, grad)
        else:  # 16-bit: the rows added straight into a float32 sum over the micro-batches, rounded once
            ctx.taken.accumulator(ctx.leaf).index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float())
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``; in a unit's backward, its weight's gradient may be taken later, with its other
    micro-batches' (see the module docstring). Any other use is ``F.embedding`` itself."""
    taken = taking(weight, None)
    if taken is not None:
        return _Embedding.apply(ids, weight, taken)
    return F.embedding(ids, weight)


class Embedding(nn.Embedding):
    """``nn.Embedding`` computing by :func:`embedding` where it has none of ``padding_idx``, ``max_norm``,
    ``scale_grad_by_freq`` and ``sparse`` (which take ``nn.Embedding``'s own path)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.padding_idx is None and self.max_norm is None and not self.scale_grad_by_freq and not self.sparse:
            return embedding(ids, self.weight)
        return super().forward(ids)


def output_projection(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias) by :func:`linear`, or its gradient-only stand-in while the engine recomputes:
    in a recompute only the gradient graph of the layer's output is used, so an output projection's forward
    matmul (5 of GPT-J's 12·H² multiply-adds per token, a third of a Llama layer's) can be skipped."""
    if recomputing() and torch.is_grad_enabled():
        return _Linear.apply(x, weight, None, taking(weight, None), False)
    return linear(x, weight)


@functools.cache
def _bfloat16_attention_kernels() -> bool:
    """Whether ATen's CPU flash attention has its bfloat16 (AVX-512 BF16 / AMX) kernels here: the CPU has
    them and torch dispatches to its AVX-512 code (``ATEN_CPU_CAPABILITY=avx2`` on such a CPU does not)."""
    cpu = torch.cpu
    has = getattr(cpu, "_is_avx512_bf16_supported", None)
    return bool(has and has()) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def attention_in_float32(x: torch.Tensor, head_dim: int, positions: int) -> bool:
    """Whether a training attention (no cache) over ``positions`` keys of ``head_dim``, on 16-bit ``x``, runs
    faster in float32 (q, k and v cast up, the output cast back) than in ``x``'s dtype: on the CPU, unless it
    is bfloat16 with ATen's bfloat16 kernels, heads of 128 or more and 256 positions or more.

    The thresholds come from timing forward and backward with the casts at GPT-J's, Llama's and toy head
    shapes (docs/performance.md); float16 has no such kernels. On a GPU the 16-bit kernels are the fast ones.
    """
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    fast = x.dtype == torch.bfloat16 and head_dim >= 128 and positions >= 256 and _bfloat16_attention_kernels()
    return not fast
