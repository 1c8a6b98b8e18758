"""A unit's compute over every micro-batch: its forward, and its backward with the gradients it produces.

The decoder's backward recomputes each layer's forward from its buffered input ``x[n][mb]`` (with
``execution.recompute=false`` the forward keeps its graph for the backward instead, :class:`KeptGraphs`).
Each micro-batch's backward is seeded with ``S · n_mb · DP / n`` (``S`` the loss scale, ``n_mb`` its trained
tokens, ``n`` the step's over every micro-batch and DP rank: :attr:`StepState.weights`), so that the unit's
gradient, mean-reduced over DP, is that of the step's loss, the mean over every trained token of the step, as
transformers' Trainer (``num_items_in_batch``) and TRL weight it; :class:`~ipuft.engine.gradients.GradientSum`
sums them.
What a module call runs under is set here alone in training (the inference engine and the plan's measurements
set the same for theirs), each a context variable documented in its own module: the micro-batch's positions
(:func:`ipuft.attention.examples_apart`, so that a recompute attends as its forward did) and the layer
(:func:`ipuft.attention.decoder_layer`: its window, its rotary) in :meth:`UnitCompute.call`; in the backward,
the weight gradients taken later (:func:`ipuft.ops.taking_weight_gradients`), the head's loss by chunks of tokens
told the seed (:func:`ipuft.head_loss.head_chunks`) and a forward run only for its gradient
(:func:`ipuft.components.recompute`), and for preference data the pairs whose loss the head computes
(:meth:`StepState.pairs`, :mod:`ipuft.preference`). Nothing else changes what a component computes.
Under DP each unit's gradient is mean-reduced over the DP group once, after its micro-batch loop
(reduce-scattered with RTS); :mod:`ipuft.engine.placement` has the forms a variable takes.
"""

from __future__ import annotations

import contextlib
import zlib

import torch

from ipuft.attention import decoder_layer, examples_apart
from ipuft.components import DrawsMasks, bound, recompute
from ipuft.data.batch import Batch
from ipuft.engine.activations import ActivationBuffers, working_set
from ipuft.engine.cuts import take_every, writes_into_stored
from ipuft.engine.gradients import GradientSum
from ipuft.engine.sliced import StoredSlices
from ipuft.engine.state import StepState
from ipuft.engine.store import Tensors, storage_bytes
from ipuft.engine.stored import StoredModel
from ipuft.head_loss import head_chunks
from ipuft.ops import WeightGradients, taking_weight_gradients
from ipuft.program import Entry, OpActivations, Phase, Unit


class KeptGraphs:
    """recompute=false: one unit's kept forward graphs, per micro-batch (output, input leaves, saved bytes),
    the weight leaves their gradients accumulate into, and the weight gradients their backward leaves to be
    taken."""

    def __init__(self, leaves: Tensors) -> None:
        self.leaves = leaves
        self.taken = WeightGradients(leaves.values())  # the graphs' projections keep their pieces here
        self._kept: dict[int, tuple[torch.Tensor | None, list[torch.Tensor], int]] = {}

    def append(self, out: torch.Tensor | None, inputs: list[torch.Tensor], size: int) -> None:
        self._kept[len(self._kept)] = (out, inputs, size)

    def pop(self, mb: int) -> tuple[torch.Tensor | None, list[torch.Tensor], int]:
        return self._kept.pop(mb)


def _tokens(batch: Batch) -> list[torch.Tensor]:
    """The step's batch tensors, which live for the whole step: no graph's saved bytes."""
    return [t for t in (batch.input_ids, batch.labels, batch.positions, batch.reference) if t is not None]


class UnitCompute:
    """Runs a unit's forward and backward over every micro-batch of a step, on a :class:`StoredModel`'s
    modules, reading and writing the step's activation buffers."""

    def __init__(self, model: StoredModel, buffers: ActivationBuffers) -> None:
        self.model = model
        self.buffers = buffers
        self.store = model.store
        self.recompute = bool(model.cfg.execution.recompute)
        # A component may draw masks of its own (an adapter's dropout): ``uses_dropout`` says so.
        self.dropout = model.cfg.model.dropout_prob > 0 or any(isinstance(m, DrawsMasks) and m.uses_dropout
                                                              for m in model.modules.values())
        self.chunks = (model.cfg.execution.head_chunk_tokens, model.cfg.execution.head_vocab_slices)  # the head's
        self.graphs: dict[str, KeptGraphs] = {}
        self._counted: dict[str, int] = {}  # each unit's gradients' bytes counted on the device, until released
        self.graph_bytes = self.graph_peak = 0  # kept graphs' saved bytes now, and the step's peak

    def call(self, unit: Unit, mb: int, st: StepState) -> contextlib.ExitStack:
        """What micro-batch ``mb``'s module call of ``unit`` runs under, the same in its forward, its recompute
        and its kept graph: its dropout masks (:meth:`rng`), its rows' examples (:func:`examples_apart`), and
        which decoder layer it is (:func:`ipuft.attention.decoder_layer`; ``None`` for the other units)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.rng(unit, mb, st.update))
        stack.enter_context(examples_apart(st.positions[mb] if st.positions else None))
        stack.enter_context(decoder_layer(unit.layer))
        return stack

    def rng(self, unit: str, mb: int, update: int):
        """The same dropout masks in a layer's forward and in its recompute; the same within a TP group,
        different across DP ranks and updates."""
        if not self.dropout:
            return contextlib.nullcontext()
        layout = self.model.layout
        key = (self.model.cfg.model.seed, update, layout.dp_rank, zlib.crc32(unit.encode()), mb)
        seed = zlib.crc32(repr(key).encode())
        devices = [self.model.device] if self.model.device.type == "cuda" else []

        @contextlib.contextmanager
        def seeded():
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield

        return seeded()

    # ---- forward ----

    def forward(self, phase: Phase, io: OpActivations, weights: Tensors, st: StepState) -> None:
        """Every micro-batch's forward: from the token ids (the first unit) or the entry the op reads, into
        the entry it writes; no autograd state is kept (with recompute)."""
        if not self.recompute:
            return self._forward_keeping_graphs(phase, io, weights, st)
        module = self.model.modules[phase.role]
        source, (target,) = io.read("x"), io.writes
        with torch.no_grad(), bound(module, weights):
            for mb in range(st.batch.micro_batches):
                if source is None:
                    with self.call(phase.unit, mb, st):
                        out = module(st.batch.input_ids[mb])
                else:
                    with self.buffers.read(*source, mb) as x, self.call(phase.unit, mb, st):
                        out = module(x)
                self.buffers.write(*target, mb, out)

    def _forward_keeping_graphs(self, phase: Phase, io: OpActivations, weights: Tensors, st: StepState) -> None:
        """recompute=false: run every micro-batch's forward with autograd and keep each graph (its output and
        the input leaf) until the unit's backward, which then needs no recompute. The tensors autograd saves
        stay counted on the device from here to there."""
        module = self.model.modules[phase.role]
        source, (target,) = io.read("x"), io.writes
        params, leaves = self._autograd_weights(phase, weights)
        graphs = KeptGraphs(leaves)
        with bound(module, params), taking_weight_gradients(graphs.taken):
            for mb in range(st.batch.micro_batches):
                with contextlib.ExitStack() as stack:
                    inputs, args = self._unit_input(stack, source, mb, st.batch.input_ids, consume=False)
                    if not inputs and not leaves:  # a frozen first unit: its backward has nothing to do
                        with torch.no_grad(), self.call(phase.unit, mb, st):
                            out = module(*args)
                        graphs.append(None, [], 0)
                    else:
                        # The step's batch (token ids) lives for the whole step: not the graph's.
                        held = [*params.values(), *inputs, *_tokens(st.batch)]
                        saved = stack.enter_context(working_set(self.store, held, keep=True))
                        with self.call(phase.unit, mb, st):
                            out = module(*args)
                        graphs.append(out, inputs, saved.bytes)
                        self.graph_bytes += saved.bytes
                        self.graph_peak = max(self.graph_peak, self.graph_bytes)
                self.buffers.write(*target, mb, out.detach())
        self.graphs[phase.unit] = graphs

    def _autograd_weights(self, phase: Phase, weights: Tensors) -> tuple[Tensors, Tensors]:
        """The unit's weights to bind for a forward with autograd, and the leaves among them: trainable weights
        become fresh leaves (their gradients accumulate there); frozen ones are bound as they are, without
        autograd, so no gradient is computed for them."""
        trainable = self.model.differentiated[phase.role]
        params = {n: t.detach().requires_grad_() if n in trainable else t for n, t in weights.items()}
        return params, {n: p for n, p in params.items() if n in trainable}

    def _unit_input(self, stack: contextlib.ExitStack, source: Entry | None, mb: int, input_ids: torch.Tensor,
                    consume: bool) -> tuple[list[torch.Tensor], tuple]:
        """Micro-batch ``mb``'s input to a unit, for a forward with autograd: the token ids (the first unit, no
        ``source``), or the buffered activation ``source`` (``("x", row)``) as a leaf whose gradient is the
        ``dx`` upstream needs; returns ``(input leaves, call arguments)``."""
        if source is None:
            return [], (input_ids[mb],)
        x = stack.enter_context(self.buffers.read(*source, mb, consume=consume)).detach().requires_grad_()
        return [x], (x,)

    # ---- backward ----

    def gradients(self, phase: Phase, io: OpActivations, weights: Tensors, st: StepState,
                  carried: Tensors | None = None) -> Tensors:
        """The gradient of the unit's trainable variables over every micro-batch, reduced over DP, in its
        stored form and its weights' dtype (16-bit weights: summed in float32, rounded once at the end).

        Tied variables (:class:`ipuft.program.Tie`) are summed exactly: the gradient of one the unit uses and
        does not own stays float32, for its owner's stored gradient; to the gradient of one it owns, the
        other uses' parts (``carried``, float32, in the stored form) are added before the one rounding.

        The ledger counts the gradients alive as they are made (autograd's, the float32 sums, the takes'),
        but for those written into the unit's stored gradients, whose memory is the store's, until the phase
        releases them (:meth:`release`); :func:`ipuft.engine.cuts.gradient_working_bytes` is what the
        plan declares for them."""
        carried = carried or {}
        wide = self.model.dtype != torch.float32
        lent = {t.name for t in self.model.program.used_ties(phase.role)}
        local, homes, counted = self._backward(phase, io, weights, st, wide, lent | set(carried))
        placed = self.model.uses[phase.role]
        grads = {}
        for n, local_grad in local.items():
            g = placed[n].reduce_gradient(local_grad)
            if n in carried:
                g = g.float().add_(carried[n])
            grads[n] = g if n in lent else g.to(weights[n].dtype)
        fresh = storage_bytes(grads.values(), homes.values())
        self.store.hold(fresh - counted)
        self._counted[phase.unit] = fresh
        return grads

    def release(self, phase: Phase) -> None:
        """The phase is done with the gradients :meth:`gradients` made (stored, or consumed by the update)."""
        self.store.free(self._counted.pop(phase.unit, 0))

    def _backward(self, phase: Phase, io: OpActivations, weights: Tensors, st: StepState,
                  wide: bool, exact: set[str]) -> tuple[Tensors, Tensors, int]:
        """Loss-backward (head) or recompute-backward (decoder, embeddings) of every micro-batch; returns the
        unit's gradients summed over micro-batches (:class:`GradientSum`), the stored gradients the takes
        wrote into, and the bytes of the others, counted on the device.

        The weights the unit's projections compute with by :func:`ipuft.ops.linear` get their gradients taken
        later (see :mod:`ipuft.ops`): one matmul over the tokens of :func:`take_every` micro-batches at a time,
        each such gradient summed as a micro-batch's is. While they wait, what the projections hold for them
        is counted on the device. The ``exact`` variables' 16-bit gradients are summed in float32 and not
        rounded (tied ones, see :meth:`gradients`)."""
        graphs = self.graphs.pop(phase.unit, None)
        params, leaves = self._autograd_weights(phase, weights)
        if graphs is not None:
            leaves = graphs.leaves  # the kept graphs accumulate into the leaves their forward bound
        micro_batches = st.batch.micro_batches
        slices = StoredSlices(self.model, phase, leaves, st)  # where a head's gradient by vocabulary slices goes
        taken = WeightGradients(leaves.values(), slices) if graphs is None else graphs.taken
        every = take_every(micro_batches, st.batch.input_ids[0].numel())
        takes = -(-micro_batches // every)
        names = {id(p): n for n, p in leaves.items()}
        dp = self.model.layout.data_parallel
        sums = GradientSum(leaves, wide, self.model.device, dp, exact)
        stored = {n: t for n, t in self._gradient_homes(phase).items() if n not in exact}
        homes = stored if writes_into_stored(wide, takes, dp, bool(stored)) else {}
        module = self.model.modules[phase.role]
        held = counted = 0

        def count() -> None:  # the gradients alive now, but for those in the stored gradients' memory
            nonlocal counted
            alive = sums.bytes(homes.values())
            self.store.hold(alive - counted)
            counted = alive

        with bound(module, params), taking_weight_gradients(taken):
            for mb in range(micro_batches):
                if graphs is None:
                    self._backward_micro_batch(phase, io, list(leaves.values()), mb, st, list(params.values()))
                else:
                    self._backward_kept_graph(io, graphs, mb, list(leaves.values()))
                sums.add_autograd(mb, micro_batches)
                count()
                holding = storage_bytes([*taken.held(), *taken.deferred_held(), *(t for _, t in taken.accumulated())])
                self.store.hold(holding - held)
                held = holding
                if (mb + 1) % every and mb + 1 < micro_batches:
                    continue
                final = mb + 1 == micro_batches
                if final:  # the sums ops accumulated become the unit's gradients: counted there from now
                    summed = storage_bytes(total for _, total in taken.accumulated())
                    self.store.free(summed)
                    held -= summed
                for leaf, grad in taken.take(lambda leaf: homes.get(names[id(leaf)]), final):
                    sums.add(names[id(leaf)], grad, mb // every, takes)
                    count()
                self.store.free(held)
                held = 0
        return sums.result(), homes, counted

    def _gradient_homes(self, phase: Phase) -> Tensors:
        """The gradients ``phase``'s unit stored last step, where they are kept in the compute device's memory
        (a CPU device, or offload off): memory that a fresh gradient would fault in page by page on a CPU."""
        if self.store.offload and not self.store.lends:
            return {}
        return self.store.entries[phase.unit].get("grad", {})

    def _backward_micro_batch(self, phase: Phase, io: OpActivations, params: list[torch.Tensor], mb: int,
                              st: StepState, weights: list[torch.Tensor]) -> None:
        """Run micro-batch ``mb``'s forward with gradient (the head's loss, or a recompute seeded by the ``dx``
        entry the op reads), backpropagate into ``params``, and keep the gradient of the unit's input as the
        ``dx`` entry the op writes. ``weights``: every weight bound, frozen ones too, which autograd may save
        but which are counted as loaded."""
        module = self.model.modules[phase.role]
        with contextlib.ExitStack() as stack:
            inputs, args = self._unit_input(stack, io.read("x"), mb, st.batch.input_ids, consume=True)
            upstream = io.read("dx")
            if upstream is None:  # the head: loss, and the gradient that seeds the backward
                args = (*args, st.batch.labels[mb])
                seed = None
                # A head computes its loss a chunk of tokens at a time (ipuft.head_loss), told the seed below.
                stack.enter_context(head_chunks(self.chunks[0], st.loss_scale * st.weight(mb), self.chunks[1]))
                if st.batch.reference is not None:  # preference data: the loss is the pairs' (ipuft.preference)
                    st.pair_sums.append(stack.enter_context(st.pairs(mb)).sums)
            else:
                seed = stack.enter_context(self.buffers.read(*upstream, mb, consume=True))
                stack.enter_context(recompute())  # only the gradient of this forward is used
            stack.enter_context(working_set(self.store, [*weights, *inputs, *_tokens(st.batch)]))
            if not inputs and not params:
                return  # a frozen first unit: nothing upstream needs a gradient, nothing here is trained
            with self.call(phase.unit, mb, st):
                out = module(*args)
            if seed is None:
                st.losses.append(out.detach())
                out = out * (st.loss_scale * st.weight(mb))
            torch.autograd.backward(out, seed, inputs=inputs + params)
        if inputs:
            self.buffers.write(*io.written("dx"), mb, inputs[0].grad)

    def _backward_kept_graph(self, io: OpActivations, graphs: KeptGraphs, mb: int,
                             leaves: list[torch.Tensor]) -> None:
        """recompute=false: backpropagate micro-batch ``mb``'s kept forward graph with the ``dx`` entry the op
        reads (no recompute; the ``x`` entry it reads is only done with), and keep the gradient of the unit's
        input as the ``dx`` entry it writes."""
        out, inputs, size = graphs.pop(mb)
        with contextlib.ExitStack() as stack:
            for entry in io.reads:  # the seed, and the layer input's entry, done with as after a recompute
                read = stack.enter_context(self.buffers.read(*entry, mb, consume=True))
                if entry[0] == "dx":
                    seed = read
            if out is not None:
                torch.autograd.backward(out, seed, inputs=inputs + leaves)
        self.store.free(size)
        self.graph_bytes -= size
        if inputs:
            self.buffers.write(*io.written("dx"), mb, inputs[0].grad)

    def end_step(self) -> int:
        """The step is over: its kept graphs' peak bytes (recompute=false), counted afresh from the next."""
        peak, self.graph_peak = self.graph_peak, 0
        return peak
