"""A head's weight gradient made one vocabulary slice at a time, kept out of the device's memory.

With ``execution.head_vocab_slices`` above 1 the head's loss (:mod:`ipuft.head_loss`) computes each
micro-batch's loss and input gradient with the whole weight, keeps its tokens' log-sum-exp, and makes the
weight's gradient at the unit's last take, a slice of vocabulary rows at a time over every micro-batch's
tokens. :class:`StoredSlices` is where that work keeps and puts things in the engine: each micro-batch's
input ``x`` waits in host memory (sent as an activation, brought back once per slice), and each finished
slice is reduced over DP, its share of the global norm added, and written into the stored gradient it
belongs to (the head's own, in the weights' dtype; a tied table's, float32, in its owner's stored gradient,
as a lent gradient is), counted as a gradient sent. So the head phase holds its weight, one slice's float32
sum and a chunk's logits over the slice, not the weight's whole float32 gradient (3.75 GiB for Gemma 3's
262208 × 3840 table). On a CPU device the host is the device's memory and nothing is copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipuft.engine.gradients import squared_norm
from ipuft.engine.store import Tensors
from ipuft.ops import SliceMoves
from ipuft.profiling import section
from ipuft.program import Phase


class StoredSlices(SliceMoves):
    """The engine's :class:`~ipuft.ops.SliceMoves` for one head phase's backward (see the module docstring)."""

    def __init__(self, model, phase: Phase, leaves: Tensors, state) -> None:
        """``leaves``: the unit's weight leaves by name; ``state``: the step's
        :class:`~ipuft.engine.compute.StepState` (its squared norm and loss scale)."""
        self.store, self.state = model.store, state
        self.placed = model.uses[phase.role]
        self.names = {id(t): n for n, t in leaves.items()}
        lent = {t.name: t for t in model.program.used_ties(phase.role)}
        own = self.store.entries[phase.unit].get("grad", {})
        self.homes: dict[str, tuple[torch.Tensor, bool]] = {}
        for name, leaf in leaves.items():
            if name in lent:
                home = self.store.entries[lent[name].owner].get("grad", {}).get(lent[name].variable)
            else:
                home = own.get(name)
            if home is not None and (home.shape == leaf.shape or self.placed[name].sharded_over_dp):
                self.homes[name] = (home, name in lent)
        # A tied table's unit whose gradient stays in host memory: its lookups' rows are added in there.
        self.tables = host_tables(model, phase) if phase.computes_gradient else {}

    def stash(self, t: torch.Tensor) -> torch.Tensor:
        return self.store.send(t, "activation", copy=False)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        return self.store.bring(t, "activation", copy=False)

    def done(self, t: torch.Tensor) -> None:
        self.store.free(t.numel() * t.element_size())

    def output(self, leaf: torch.Tensor) -> torch.Tensor | None:
        return None if self.names.get(id(leaf)) in self.homes else super().output(leaf)

    def put(self, leaf: torch.Tensor, out: torch.Tensor | None, start: int, grad: torch.Tensor) -> None:
        if out is not None:
            return super().put(leaf, out, start, grad)
        name = self.names[id(leaf)]
        home, lent = self.homes[name]
        placement = self.placed[name]
        if placement.sharded_over_dp:  # RTS: the slice's mean over DP, of which this rank keeps its shard's part
            layout = placement.layout
            with section("collectives"):
                dist.all_reduce(grad, group=layout.dp_group)
            grad.div_(layout.data_parallel)
            begin, mine = start * grad[0].numel(), layout.dp_rank * home.numel()
            lo, hi = max(begin, mine), min(begin + grad.numel(), mine + home.numel())
            if lo >= hi:
                return None
            part, target = grad.view(-1)[lo - begin : hi - begin], home.view(-1)[lo - mine : hi - mine]
        else:
            part, target = placement.reduce_gradient(grad), home[start : start + grad.shape[0]]
        final = part if lent else part.to(home.dtype)
        if not lent and placement.norm_weight():  # a lent gradient's owner counts it, with its other uses'
            with torch.no_grad():
                self.state.norm_sq += squared_norm([final]).to(self.state.norm_sq.device) / self.state.loss_scale**2
        self.store.send_into(target, final, "grad")
        return None

    def hold(self, n: int) -> None:
        self.store.hold(n)

    def rows_home(self, weight: torch.Tensor) -> torch.Tensor | None:
        return self.tables.get(self.names.get(id(weight)))

    def add_rows(self, weight: torch.Tensor, home: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        """Send the micro-batches' ids and row gradients to host memory (counted as gradients sent) and add them
        into the table's stored float32 gradient there."""
        with section("copies"):
            ids, g = ids.to(home.device), g.to(home.device)
        self.store.sent("grad", ids.numel() * ids.element_size() + g.numel() * g.element_size())
        super().add_rows(weight, home, ids, g)


def host_tables(model, phase: Phase) -> Tensors:
    """The stored float32 gradients of the tied tables ``phase``'s unit owns, where they stay in host memory
    through its backward and update (``execution.head_vocab_slices`` with a streamed update:
    :meth:`ipuft.engine.cuts.StepShape.streamed_groups` streams the gradient): the head wrote its part there,
    by slices, and the lookups add theirs (:meth:`StoredSlices.add_rows`); empty otherwise."""
    from ipuft.engine.cuts import step_shape

    ties = model.program.owned_ties(phase.unit)
    if not ties or not step_shape(model.cfg).host_tables:
        return {}
    stored = model.store.entries[phase.unit].get("grad", {})
    return {t.variable: stored[t.variable] for t in ties if t.variable in stored}


def finish_tables(model, phase: Phase) -> Tensors:
    """After the backward of a unit whose tied tables' gradients stayed in host memory (:func:`host_tables`):
    each rounded in place to its weight's dtype (a 16-bit one: the values the gradient would have when made on
    the device, summed in float32 and rounded once), for the norm and the streamed update to read there."""
    tables = host_tables(model, phase)
    dtypes = {v.name: v.dtype for v in model.parts.variables[phase.role]}
    for name, table in tables.items():
        if dtypes[name] != torch.float32:
            for part in table.view(-1).split(1 << 24):
                part.copy_(part.to(dtypes[name]))
    return tables
