"""A language-model head's loss computed over chunks of tokens, with its gradient, so that the logits of all of a
micro-batch's tokens (and their gradient) never exist at once.

At Llama-3's vocabulary a micro-batch of 2048 tokens has float32 logits of 1 GiB, and autograd keeps them with
their softmax and its gradient: the head's loss-backward held 5 GiB. :func:`chunked_head_loss` instead takes
``head_chunk_tokens`` tokens at a time: their logits (this TP rank's vocabulary block, float32), the
cross-entropy's pieces reduced over the TP group as :func:`ipuft.parallel.vocab_parallel_cross_entropy` reduces
them, and at once the gradient of the loss with respect to those logits, ``(softmax - onehot) · keep / N``,
rounded to the compute dtype as autograd's gradient of the logits is. From it the chunk's gradient with respect
to the hidden states (``g · W``) and its part of the weight's gradient (``gᵀ · x``) are made in the forward,
and the chunk's logits are let go. The backward only scales what the forward made by the upstream gradient.

The weight's gradient is summed in float32 (16-bit weights: each chunk's ``gᵀ · x`` as a 16-bit matmul over
blocks of vocabulary rows, added into float32), over the chunks and, in the engine, over every micro-batch of
the step: where the engine takes the weight's gradient (:func:`ipuft.ops.taking_weight_gradients`) the sum
lives in its :class:`~ipuft.ops.WeightGradients` until the unit's last take, which rounds it once. Otherwise
(plain autograd) each call's sum is the weight's gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ipuft.ops import Deferred, Linear, SliceMoves, WeightGradients, taking
from ipuft.preference import active_pairs
from ipuft.profiling import section
from ipuft.widen import add_widened_, gradient_chunk

# (tokens per chunk, 0 for unchunked; the upstream gradient the caller will seed the loss's backward with;
# vocabulary slices the weight's gradient is made in, 0 or 1 for one)
_CHUNK: contextvars.ContextVar[tuple[int, float, int]] = contextvars.ContextVar("ipuft_head_chunks",
                                                                               default=(0, 1.0, 0))

ROW_BLOCK_BYTES = 64 * 2**20  # the most bytes of one 16-bit block of a chunk's weight gradient, before it is added


@contextlib.contextmanager
def head_chunks(tokens: int, seed: float = 1.0, slices: int = 0) -> Iterator[None]:
    """Heads' losses inside the block are computed ``tokens`` tokens at a time (0: all at once, autograd's own
    path). ``seed``: the upstream gradient the caller will backpropagate the loss with (the engine's loss scale
    over the micro-batches), which the loss's gradient is scaled by before it is rounded to a 16-bit compute
    dtype, as autograd scales it (a float16 gradient would underflow unscaled). ``slices`` above 1: the
    weight's gradient is made that many vocabulary slices at a time (:class:`_SlicedGradient`)."""
    token = _CHUNK.set((int(tokens), float(seed), int(slices)))
    try:
        yield
    finally:
        _CHUNK.reset(token)


def head_chunk_tokens() -> int:
    """The chunk size in force (0: unchunked)."""
    return _CHUNK.get()[0]


def chunkable(project) -> bool:
    """Whether ``project`` is a plain linear projection (``nn.Linear`` or :class:`ipuft.ops.Linear`, not a module
    that wraps or changes one), whose weight and bias the chunked loss can compute with directly."""
    return isinstance(project, torch.nn.Linear) and type(project).forward in (torch.nn.Linear.forward, Linear.forward)


def chunked_head_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                      vocab_size: int, ignore_index: int, tp_rank: int = 0, tp_group=None,
                      tensor_parallel: int = 1, softcap: float | None = None) -> torch.Tensor:
    """The mean cross-entropy over the tokens of ``x[N, H]`` whose ``labels[N]`` are not ``ignore_index``, of
    the logits ``x · weightᵀ + bias`` (TP rank ``tp_rank``'s ``weight[rows, H]`` of a vocabulary of
    ``vocab_size``, its pieces reduced over ``tp_group``), :func:`head_chunk_tokens` tokens at a time (see the
    module docstring). Its value and gradients are those of :func:`ipuft.parallel.vocab_parallel_head`'s
    unchunked loss, to float32 rounding; the gradient of ``x`` is this rank's part (under TP the caller
    all-reduces it, as :func:`ipuft.parallel.copy_to_tensor_parallel` does). ``softcap``: of the logits
    soft-capped as :func:`ipuft.parallel.softcapped` caps them (Gemma 2), its gradient through the cap taken by
    the ops autograd's backward of those three takes."""
    chunk, seed, slices = _CHUNK.get()
    if not torch.is_grad_enabled():  # the loss alone (an evaluation): no gradient is made
        x, weight, bias = x.detach(), weight.detach(), bias.detach() if bias is not None else None
    tp = _TensorParallel(tp_rank, tp_group, tensor_parallel)
    taken = taking(weight, bias)
    return _ChunkedHeadLoss.apply(x, weight, bias, labels, vocab_size, ignore_index, chunk, seed, tp, taken,
                                  softcap, slices)


class _TensorParallel:
    """The TP group's reductions of the loss's pieces (no autograd: the chunked loss makes its own gradient)."""

    def __init__(self, rank: int, group, size: int) -> None:
        self.rank, self.group, self.size = rank, group, size

    def reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            with section("collectives"):
                dist.all_reduce(x, op=op, group=self.group)
        return x


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, labels, vocab_size, ignore_index, chunk, seed, tp, taken, softcap, slices):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        rows = weight.shape[0]
        keep = labels != ignore_index
        count = keep.sum().clamp_min(1)  # no trained token: the loss 0, its gradient zero (not 0 / 0)
        first = tp.rank * rows
        grad_x = torch.empty_like(x) if need_x else None
        sliced = need_w and slices > 1 and rows > 1  # the weight's gradient made by slices, later
        sums = _Sums(weight, bias, need_w and not sliced, need_b, taken)
        total = x.new_zeros((), dtype=torch.float32)
        step = chunk or x.shape[0]
        grad = need_x or need_w or need_b
        pairs, weights = active_pairs(), None
        if pairs is not None:  # preference data: each token's weight in the gradient from every token's loss
            token = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            for start in range(0, x.shape[0], step):
                logits = _chunk_logits(x[start : start + step], weight, bias, softcap, first, vocab_size)[0]
                token[start : start + step] = _chunk_loss(logits, labels[start : start + step],
                                                          keep[start : start + step], first, tp, False)[0]
                del logits
            total, weights = pairs.token_weights(token, labels) if grad else (pairs.loss(token, labels), None)
        lses, scales = [], []  # sliced: each token's log-sum-exp and weight in the loss's gradient
        for start in range(0, x.shape[0], step) if pairs is None or grad else ():  # (pairs: only for a gradient)
            xc, yc, kc = x[start : start + step], labels[start : start + step], keep[start : start + step]
            logits, tanh = _chunk_logits(xc, weight, bias, softcap, first, vocab_size)
            if sliced and tp.size == 1:  # (before the log-softmax is written over the logits)
                lses.append(torch.logsumexp(logits, dim=-1))
            loss, probs = _chunk_loss(logits, yc, kc, first, tp, grad)
            if pairs is None:
                total += loss.sum()
            if probs is None:
                continue
            scale = kc * (seed / count) if weights is None else weights[start : start + step] * seed
            if sliced:
                if tp.size > 1:
                    lses.append(probs.shift.squeeze(-1) + probs.sums.log())
                scales.append(scale)
            g = _logits_gradient(probs, yc, kc, first, scale, tp).to(x.dtype)
            del probs, logits
            if softcap is not None:  # autograd's backward of the cap: MulBackward, TanhBackward, DivBackward
                g = torch.ops.aten.tanh_backward(g * softcap, tanh).div_(softcap)
                del tanh
            if need_x:
                if g.shape[0] >= GEMM_ROWS or g.dtype != torch.float32:
                    torch.mm(g, weight, out=grad_x[start : start + step])
                else:
                    grad_x[start : start + step] = _padded(g, lambda rows: torch.mm(rows, weight))
            sums.add(g, xc)
        if sliced:
            sums.defer(_SlicedGradient.of(weight, bias, slices, step, softcap, first, vocab_size, taken),
                       x.detach(), labels, torch.cat(lses), torch.cat(scales))
        ctx.sums, ctx.seed = sums, seed
        ctx.save_for_backward(grad_x)
        return total / count if pairs is None else total

    @staticmethod
    def backward(ctx, grad):
        (grad_x,) = ctx.saved_tensors
        # 1 where the caller seeds the backward as it said it would. A seed of 0 (a micro-batch that weighs
        # nothing in the step) made zero gradients, which an upstream 0 keeps: the factor is then 1.
        factor = grad / ctx.seed if ctx.seed else torch.where(grad == 0, 1.0, torch.nan).to(grad.dtype)
        grad_w, grad_b = ctx.sums.result(factor)
        return (grad_x * factor if grad_x is not None else None), grad_w, grad_b, *([None] * 9)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
                  first: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's float32 logits over this rank's block of the vocabulary (soft-capped; padded columns at the
    dtype's least), and the cap's tanh (kept for the gradient through it; None without a cap)."""
    rows = weight.shape[0]
    logits = _padded(x, lambda r: F.linear(r, weight, bias))
    tanh = None
    if softcap is not None:  # cap · tanh(logits / cap): tanh's result kept for the gradient through it
        tanh = logits.div_(softcap).tanh_()
        logits = tanh * softcap
    if first + rows > vocab_size:  # a padded vocabulary block (TP): padded columns never win
        padded = torch.arange(first, first + rows, device=x.device) >= vocab_size
        logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
    return logits.float(), tanh  # the 16-bit logits freed before the float32 work begins


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, first: int,
                tp: _TensorParallel, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's loss of each token (0 where not kept), and a float32 buffer ready for the logits' gradient: at TP=1
    the softmax as ``exp(log_softmax(logits))``; under TP the shifted exponentials ``exp(logits - max)``, the
    pieces summed over the group. Each is the arithmetic of the unchunked loss (``F.cross_entropy``,
    :func:`ipuft.parallel.vocab_parallel_cross_entropy`), so that a chunk's rows round as the whole micro-batch's
    do. (Not a shifted ``exp`` summed by ``torch.sum``, as before: on a CPU the log-softmax adds a row's
    exponentials one by one into a few float32 lanes, which with a peaked distribution over 49152 rows loses the
    small terms and comes out about 8e-6 low per token, so the two differed by that; transformers' loss is
    F.cross_entropy's.) The second value (None without ``grad``) carries its row
    sums as ``.sums`` (and the max they are shifted by as ``.shift``) under TP."""
    rows = logits.shape[-1]
    local = labels - first
    mine = (local >= 0) & (local < rows)
    at = local.clamp(0, rows - 1).unsqueeze(-1)
    if tp.size == 1:  # F.cross_entropy's own arithmetic: its log-softmax, row by row, and the target's entry
        # Written over the logits (the chunk's own float32 buffer): the kernel reads a row whole (its max, then
        # its sum) before it writes it, so the values are the out-of-place ones, and the chunk holds one
        # float32 [rows, vocabulary] buffer rather than two (llama3-8b: 250 MiB on its 3.55 GiB device peak).
        work = torch.log_softmax(logits, dim=-1, out=logits)
        loss = -(work.gather(-1, at).squeeze(-1) * keep)
        return loss, work.exp_() if grad else None
    shift = tp.reduce(logits.max(dim=-1, keepdim=True).values, dist.ReduceOp.MAX)
    work = logits - shift
    target = tp.reduce(work.gather(-1, at).squeeze(-1) * mine)
    work.exp_()
    sums = tp.reduce(work.sum(dim=-1))
    work.sums, work.shift = sums, shift
    return (sums.log() - target) * keep, work if grad else None


def _logits_gradient(work: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, first: int,
                     weight: torch.Tensor, tp: _TensorParallel) -> torch.Tensor:
    """d(seed · loss)/d(logits) in ``work`` (from :func:`_chunk_loss`), ``weight[N]`` = seed · keep / count: the
    softmax times the weight, less the weight at the target, in the order autograd's backward of the unchunked
    loss rounds them (the log-sum-exp's term first, then the target's scattered in)."""
    rows = work.shape[-1]
    local = labels - first
    mine = (local >= 0) & (local < rows)
    at = local.clamp(0, rows - 1).unsqueeze(-1)
    if tp.size == 1:
        work *= weight.unsqueeze(-1)
    else:
        work *= (weight / work.sums).unsqueeze(-1)
    work.scatter_add_(-1, at, -(weight * mine).unsqueeze(-1))
    return work


class _Sums:
    """A chunked head's weight and bias gradients summed over its chunks: in the engine's
    :class:`~ipuft.ops.WeightGradients` (summed on over the micro-batches, scaled at the take), or here."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, need_w: bool, need_b: bool,
                 taken: WeightGradients | None) -> None:
        self.weight, self.bias, self.taken = weight, bias, taken
        self.w = self.b = None
        self.sliced: _SlicedGradient | None = None
        if need_w:
            self.w = taken.accumulator(weight) if taken is not None else _zeros32(weight)
        if need_b:
            self.b = taken.accumulator(bias) if taken is not None else _zeros32(bias)

    def add(self, g: torch.Tensor, x: torch.Tensor) -> None:
        """Add one chunk's ``gᵀ · x`` (and ``Σ g``): float32 in place; 16-bit by blocks of vocabulary rows, each a
        16-bit matmul (float32 accumulation, rounded once) added into the float32 sum."""
        if self.w is not None:
            if g.dtype == torch.float32:
                torch.addmm(self.w, g.t(), x, out=self.w)  # (addmm, not addmm_: FLOP counters know addmm)
            else:
                block = max(1, ROW_BLOCK_BYTES // (x.shape[-1] * x.element_size()))
                for first in range(0, g.shape[-1], block):
                    part = torch.mm(g[:, first : first + block].t(), x)
                    add_widened_(self.w[first : first + block], part, gradient_chunk(x.device))
        if self.b is not None:
            self.b += g.sum(0, dtype=torch.float32)

    def defer(self, sliced: _SlicedGradient, x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
              scales: torch.Tensor) -> None:
        """The weight's gradient is ``sliced``'s, which this call's tokens are added to."""
        self.sliced = sliced
        sliced.add(self.taken.moves if self.taken is not None else _KEPT, x, labels, lse, scales)

    def result(self, factor: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradients autograd gets, ``factor`` the upstream gradient over the promised seed: none where the
        engine takes them (the factor is recorded, for the take to scale the sums by), else the sums scaled, in
        the leaves' dtypes."""
        out = []
        if self.sliced is not None:
            if self.taken is not None:
                self.taken.scale(self.weight, factor)
                out.append(None)
            else:
                out.append(self.sliced.gradient(self.weight, _KEPT, factor).to(self.weight.dtype))
        for leaf, total in ((self.weight, self.w), (self.bias, self.b)):
            if self.sliced is not None and leaf is self.weight:
                continue
            if total is None:
                out.append(None)
            elif self.taken is not None:
                self.taken.scale(leaf, factor)
                out.append(None)
            else:
                out.append(total.mul_(factor).to(leaf.dtype))
        return out[0], out[1]


GEMM_ROWS = 4  # the fewest rows a chunk's matmuls over the vocabulary are made with (see _padded)


def _padded(rows: torch.Tensor, matmul) -> torch.Tensor:
    """``matmul(rows)``, where a float32 chunk of fewer than :data:`GEMM_ROWS` rows is padded with zero rows to
    that many (and the result cut back): with one to three rows a CPU BLAS takes its matrix-vector path, whose
    sums come out otherwise rounded than the matrix-matrix path the unchunked head's many rows take (at 49152
    vocabulary rows a token's gradient 1e-5 off, against 1e-6)."""
    n = rows.shape[0]
    if n >= GEMM_ROWS or rows.dtype != torch.float32:
        return matmul(rows)
    padded = rows.new_zeros(GEMM_ROWS, *rows.shape[1:])
    padded[:n] = rows
    return matmul(padded)[:n]


def _zeros32(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device)


_KEPT = SliceMoves()  # outside the engine: a sliced gradient's inputs stay where they are


class _SlicedGradient(Deferred):
    """A head weight's gradient made one vocabulary slice at a time, after every micro-batch's loss: for each
    slice of rows, every kept token's logits over those rows (``x · W_sᵀ``, recomputed), their softmax from the
    token's log-sum-exp over the whole vocabulary (taken in the loss), the loss's gradient as the unsliced
    head makes it (the softmax times the token's weight, less it at the target; rounded to the compute dtype;
    back through a soft-cap), and the slice's ``gᵀ · x`` summed in float32 over every micro-batch. Only one
    slice's float32 sum exists at once, and the tokens' ``x`` wait where :class:`~ipuft.ops.SliceMoves` keeps
    them (host memory, in the engine), so that a 262208-row vocabulary's 3.75 GiB gradient is never on the
    device whole: each slice goes where the moves put it. The logits' matmul runs once more per token (a third
    more of the head's work). The values are the unsliced head's to float32 rounding: the softmax is
    ``exp(logits - lse)`` rather than the exponential of the log-softmax."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, slices: int, step: int,
                 softcap: float | None, first: int, vocab_size: int) -> None:
        self.weight, self.bias, self.step, self.softcap = weight, bias, step, softcap
        self.first, self.vocab_size = first, vocab_size
        self.rows = -(-weight.shape[0] // slices)
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @classmethod
    def of(cls, weight, bias, slices, step, softcap, first, vocab_size, taken: WeightGradients | None):
        """The unit's one sliced gradient of ``weight`` (in ``taken``, over its micro-batches), or this call's."""
        def make() -> _SlicedGradient:
            return cls(weight, bias, slices, step, softcap, first, vocab_size)

        return taken.deferred(weight, make) if taken is not None else make()

    def add(self, moves: SliceMoves, x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
            scales: torch.Tensor) -> None:
        self.records.append((moves.stash(x), labels, lse, scales))

    def held(self) -> list[torch.Tensor]:
        return [t for record in self.records for t in record[1:]]

    @torch.no_grad()
    def gradient(self, leaf: torch.Tensor, moves: SliceMoves, factor: torch.Tensor | None) -> torch.Tensor | None:
        weight, bias = self.weight.detach(), self.bias.detach() if self.bias is not None else None
        rows, hidden = weight.shape
        out = moves.output(leaf)
        for start in range(0, rows, self.rows):
            stop = min(rows, start + self.rows)
            w, b = weight[start:stop], bias[start:stop] if bias is not None else None
            total = torch.zeros(stop - start, hidden, dtype=torch.float32, device=weight.device)
            moves.hold(total.numel() * 4)
            for stashed, labels, lse, scales in self.records:
                x = moves.fetch(stashed)
                for first in range(0, x.shape[0], self.step):
                    window = slice(first, first + self.step)
                    self._add(total, w, b, start, x[window], labels[window], lse[window], scales[window])
                moves.done(x)
            if factor is not None:
                total.mul_(factor)
            moves.put(leaf, out, start, total)
            moves.hold(-total.numel() * 4)
            del total
        self.records.clear()
        return out

    def _add(self, total: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, start: int, x: torch.Tensor,
             labels: torch.Tensor, lse: torch.Tensor, scales: torch.Tensor) -> None:
        """Add one chunk of tokens' ``gᵀ · x`` over the slice of rows ``start …`` (``w``, ``b``) to ``total``."""
        logits = _padded(x, lambda rows: F.linear(rows, w, b))
        tanh = None
        if self.softcap is not None:
            tanh = logits.div_(self.softcap).tanh_()
            logits = tanh * self.softcap
        begin = self.first + start
        if begin + w.shape[0] > self.vocab_size:  # a padded vocabulary block (TP): padded rows are no token's
            padded = torch.arange(begin, begin + w.shape[0], device=x.device) >= self.vocab_size
            logits = logits.masked_fill(padded, torch.finfo(logits.dtype).min)
        g = logits.float().sub_(lse.unsqueeze(-1)).exp_().mul_(scales.unsqueeze(-1))
        local = labels - begin
        mine = (local >= 0) & (local < w.shape[0])
        g.scatter_add_(-1, local.clamp(0, w.shape[0] - 1).unsqueeze(-1), -(scales * mine).unsqueeze(-1))
        g = g.to(x.dtype)
        if tanh is not None:
            g = torch.ops.aten.tanh_backward(g * self.softcap, tanh).div_(self.softcap)
        if g.dtype == torch.float32:
            torch.addmm(total, g.t(), x, out=total)
        else:
            block = max(1, ROW_BLOCK_BYTES // (x.shape[-1] * x.element_size()))
            for row in range(0, g.shape[-1], block):
                add_widened_(total[row : row + block], torch.mm(g[:, row : row + block].t(), x),
                             gradient_chunk(x.device))
