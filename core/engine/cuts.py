"""How the engine cuts its work: the rules it runs by and the cost model (:mod:`ipuft.plan`) counts by.

- the update: how many elements one optimizer call takes (:func:`call_chunk`), where its pieces may start
  (:func:`piece_multiple`), the groups of pieces each call updates (:func:`update_groups`), whether it runs in
  one pass (:func:`one_pass`) and what it adds on the device (:func:`group_transient_bytes`);
- the streamed update: which groups stream (:meth:`StepShape.streamed_groups`), how large a piece is
  (:func:`piece_elements`) and whether the next is copied during this one (:func:`double_buffered`);
- the gradients: how many micro-batches a weight-gradient take covers (:func:`take_every`), whether the takes
  write into the stored gradients (:func:`writes_into_stored`), what summing holds
  (:func:`gradient_working_bytes`);
- the activations: one buffered entry's bytes (:attr:`StepShape.activation_bytes`, its TP slice) and what a
  step spills to disk (:attr:`StepShape.spill_bytes`).

They read a :class:`StepShape` (:func:`step_shape`: the config's sizes and choices, typed once), not the config.

A rule changed here changes what runs and what the plan says together: the tests that hold the engine's counters
equal to the plan hold them to these functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ipuft.optim import Optimizer, has_fused_step
from ipuft.precision import Recipe, compute_dtype, rounding_workspace
from ipuft.program import Phase, PhaseMoves


def update_chunk(device: torch.device | str) -> int:
    """The most elements one optimizer call updates on ``device`` (see :meth:`UnitUpdate.step`).

    On the CPU a few hundred thousand: the pieces of weight, gradient, state and temporaries one call touches
    (a few MB) stay in cache between the update's passes, where 16-bit rounding's int32 passes run fastest
    (``bench/update.py`` measures it). On a GPU, where each pass is a kernel launch, a few million, so that
    launches stay few."""
    return 1 << 18 if torch.device(device).type == "cpu" else 1 << 22


def update_groups(sizes: list[tuple[str, int]], chunk: int | None,
                  multiple: int = 1) -> Iterator[list[tuple[str, int, int]]]:
    """The groups of pieces ``(variable, start, stop)`` that one optimizer call each updates: the flat elements
    of the variables ``sizes`` (``(name, numel)``, in order) cut into pieces and grouped so that a group holds
    at most ``chunk`` elements; with ``chunk`` ``None``, each variable whole, one per group.

    Every piece starts at a multiple of ``multiple`` elements of its flattened variable (an optimizer's
    :attr:`~ipuft.optim.Optimizer.block_size`): a piece that would end inside a variable ends at the last such
    multiple that fits, and a group with less room than that is closed. ``chunk`` is at least ``multiple``."""
    if chunk is None:
        yield from ([(name, 0, numel)] for name, numel in sizes if numel)
        return
    multiple = max(1, multiple)
    chunk = max(chunk, multiple)
    group: list[tuple[str, int, int]] = []
    room = chunk
    for name, numel in sizes:
        start = 0
        while start < numel:
            take = numel - start if numel - start <= room else room - room % multiple
            if not take:  # not a whole multiple left in this group: the piece starts the next one
                yield group
                group, room = [], chunk
                continue
            group.append((name, start, start + take))
            room -= take
            start += take
            if not room:
                yield group
                group, room = [], chunk
    if group:
        yield group


def piece_multiple(optimizer: Optimizer) -> int:
    """Where the optimizer's pieces may start: a multiple of its block-wise state's
    :attr:`~ipuft.optim.Optimizer.block_size` (1, anywhere, by default)."""
    return max(1, int(optimizer.block_size or 1))


def call_chunk(optimizer: Optimizer, device: torch.device | str, limit: int | None = None) -> int | None:
    """The most elements one call of ``optimizer`` updates on ``device`` (:func:`update_chunk`, and at most
    ``limit``: a streamed piece's), or ``None`` for an optimizer that is not elementwise (whole variables)."""
    if not optimizer.elementwise:
        return None
    return min(update_chunk(device), limit) if limit else update_chunk(device)


def one_pass(optimizer: Optimizer, how: Recipe, device: torch.device | str) -> bool:
    """Whether the optimizer's calls on ``device`` run its one-pass ``fused_step`` (:mod:`ipuft.engine.fused`),
    which makes no float32 views, gradients or rounding workspace."""
    from ipuft.engine import fused

    return (has_fused_step(optimizer) and how in (Recipe.exact, Recipe.stochastic)
            and torch.device(device).type == "cpu" and fused.library() is not None)


def group_transient_bytes(how: Recipe, pieces: list[int], single_pass: bool = False) -> int:
    """The device bytes one optimizer call over pieces of these sizes adds, besides what the optimizer itself
    makes: for 16-bit weights the float32 gradients, the float32 views (unless a master copy is the view)
    and the stochastic rounding's workspace; nothing for float32 weights, updated in place, nor for a call
    ``single_pass`` (:func:`one_pass`)."""
    if how is Recipe.exact or not pieces or single_pass:
        return 0
    numel = sum(pieces)
    views = numel * (4 if how is Recipe.master else 8)
    return views + (rounding_workspace(max(pieces)) if how is Recipe.stochastic else 0)


def piece_elements(piece_bytes: int, numel: int, streamed_bytes: int) -> int:
    """How many elements one streamed call updates: ``piece_bytes`` of the unit's streamed groups, whose
    ``streamed_bytes`` cover ``numel`` elements of trainable variables (at least one element)."""
    return max(1, piece_bytes * numel // max(streamed_bytes, 1))


def double_buffered(device: torch.device | str) -> bool:
    """Whether the next piece is copied while the current one updates (CUDA: two pieces on the device)."""
    return torch.device(device).type == "cuda"


def _summing_bytes(size: int, wide: bool, parts: int, data_parallel: int) -> int:
    """The most bytes gradients of ``size`` bytes hold while ``parts`` of them are summed (:class:`GradientSum`).
    With 16-bit weights (``wide``): a 16-bit part beside the float32 sums (twice ``size``), except where no
    float32 reduction over DP follows and two parts at most are summed, which needs only the 16-bit parts.
    Otherwise the accumulated gradients and, from the second part on, the new one beside them."""
    if wide:
        return parts * size if data_parallel == 1 and parts <= 2 else 3 * size
    return 2 * size if parts > 1 else size


def writes_into_stored(wide: bool, takes: int, data_parallel: int, stored: bool) -> bool:
    """Whether a unit's taken weight gradients are written into the gradients it stored the step before
    (``stored``: it has them, in the compute device's memory): where one take is the whole local gradient, in
    16 bits only with no float32 sum over DP to follow."""
    return stored and takes == 1 and (not wide or data_parallel == 1)


def gradient_working_bytes(autograd: int, taken: int, wide: bool, micro_batches: int, takes: int,
                           data_parallel: int, into_stored: bool) -> int:
    """The most bytes a unit's backward holds for its gradients beyond its stored ones: ``autograd`` bytes of
    them made by autograd and summed over the micro-batches, ``taken`` bytes taken over ``takes`` takes
    (:mod:`ipuft.ops`), nothing for those when they are written into the stored gradients (``into_stored``,
    see :func:`writes_into_stored`)."""
    taken_part = 0 if into_stored else _summing_bytes(taken, wide, takes, data_parallel)
    return _summing_bytes(autograd, wide, micro_batches, data_parallel) + taken_part


TAKE_TOKENS = 2048  # a weight gradient taken over this many tokens at least runs at the forward's rate


def take_every(micro_batches: int, tokens: int) -> int:
    """How many micro-batches of ``tokens`` tokens each a unit's taken weight gradients cover at a time (see
    :mod:`ipuft.ops`): enough for ``TAKE_TOKENS`` tokens, at most all of them. Each take's inputs and output
    gradients are held until it is taken, so the bound is also what they cost."""
    return max(1, min(micro_batches, TAKE_TOKENS // max(tokens, 1)))


@dataclass(frozen=True)
class StepShape:
    """What the cutting rules read of a run's config, typed and taken once (:func:`step_shape`): the engine and
    the plan pass this, not the config."""

    layers: int
    micro_batches: int  # per step (gradient_accumulation)
    tokens: int  # per micro-batch (micro_batch_size × sequence_length)
    hidden: int
    itemsize: int  # of the compute dtype
    tensor_parallel: int
    spills: bool  # activation_offload=disk
    streams: bool  # offload, an update on the device, and update_piece_bytes above 0
    host_update: bool  # optimizer_placement=host: updates run in host memory, where the variables live
    host_tables: bool = False  # a tied table's gradient stays in host memory (see streamed_groups)

    @property
    def activation_bytes(self) -> int:
        """One micro-batch's layer-boundary activation ``x[n][mb]``, in the compute dtype."""
        return self.tokens * self.hidden * self.itemsize

    @property
    def stored_activation_bytes(self) -> int:
        """What one TP rank stores of one buffered activation: its 1/TP slice."""
        return self.activation_bytes // self.tensor_parallel

    @property
    def spill_bytes(self) -> int:
        """The bytes one rank writes to disk (and reads back) each step with ``activation_offload=disk``: the
        ``x`` entry of every decoder layer's input (:func:`ipuft.engine.spill.spilled_rows`) for each
        micro-batch, its TP slice; 0 otherwise."""
        return self.layers * self.micro_batches * self.stored_activation_bytes if self.spills else 0

    def streamed_groups(self, phase: Phase, moves: PhaseMoves | None) -> frozenset[str]:
        """The groups ``phase`` streams to its update piece by piece instead of loading them whole: where the
        update streams (:attr:`streams`), every group of an update-only phase, and the optimizer state of a
        phase that computes (its weights and gradient are the compute's). With :attr:`host_tables`
        (``execution.head_vocab_slices``, one DP rank), the gradient too of a phase that adds the other uses'
        parts of tied tables to its own: it stays in host memory (:mod:`ipuft.engine.sliced`), where the head
        wrote its part by slices, so that a tied table's float32 gradient is never whole on the device. (Under
        DP the lookups' part would need a mean over the ranks there: the table's gradient is loaded instead.)"""
        if moves is None or not phase.updates or not self.streams:
            return frozenset()
        loads = frozenset(m.group for m in moves.loads)
        if not phase.computes:
            return loads
        return loads & {"optim"} | ({"grad"} if self.host_tables and moves.carries else frozenset())


def step_shape(cfg: DictConfig) -> StepShape:
    """The run's :class:`StepShape`."""
    m, ex = cfg.model, cfg.execution
    host_update = ex.optimizer_placement.value == "host"
    streams = bool(ex.offload) and bool(ex.update_piece_bytes) and not host_update
    return StepShape(
        layers=m.layers, micro_batches=cfg.gradient_accumulation, tokens=ex.micro_batch_size * m.sequence_length,
        hidden=m.hidden_size, itemsize=torch.empty((), dtype=compute_dtype(cfg)).element_size(),
        tensor_parallel=ex.tensor_parallel, spills=ex.activation_offload == "disk",
        streams=streams, host_update=host_update,
        host_tables=streams and ex.head_vocab_slices > 1 and ex.data_parallel == 1 and ex.recompute is not False)
