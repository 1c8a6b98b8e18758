"""The phased execution engine: runs the step program, phase by phase, over every micro-batch.

Each phase brings one unit's variables to the compute device, loops over all gradient-accumulation
micro-batches (layer-major batch serialisation), and stores back what it changed. The decoder's backward
recomputes each layer's forward from its buffered input ``x[n][mb]`` (with ``execution.recompute=false`` the
forward keeps its graph for the backward instead). The global gradient norm gathers every unit's gradient
before any optimizer step runs, as in the reference's ``finetuning()``; then core finishes every gradient
(the loss scale removed, clipping applied) and the optimizer updates each unit's trainable variables
together (:meth:`ipuft.optim.Optimizer.step_unit`). Frozen variables get no gradient and no update.

Gradients are accumulated carrying the loss scale ``S`` and averaged over micro-batches: each
micro-batch's backward is seeded with ``S / GA``. Under data parallelism each unit's gradient is
mean-reduced over the DP group once per step, after its micro-batch loop (reduce-scattered with RTS); see
:mod:`ipuft.engine.placement` for the forms a variable takes.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ipuft.components import VariableSpec, bound, recompute
from ipuft.data.batch import Batch
from ipuft.engine.activations import ActivationBuffers, working_set
from ipuft.engine.hostmem import retain_freed_memory
from ipuft.engine.model import ModelParts
from ipuft.engine.placement import Placement
from ipuft.engine.precision import (
    Recipe,
    add_rounded_,
    add_widened_,
    chunked_norm,
    compute_dtype,
    gradient_chunk,
    gradient_working_bytes,
    recipe,
    rounding_key,
    stochastic_round_,
    take_every,
)
from ipuft.engine.profiling import active as active_profile
from ipuft.engine.profiling import section
from ipuft.engine.scaling import LossScale
from ipuft.engine.store import Tensors, VariableStore, nbytes, storage_bytes
from ipuft.engine.update import group_transient_bytes, update_chunk, update_groups
from ipuft.engine.variables import (
    MASTER,
    Initializer,
    float32,
    initial_values,
    optimizer_state_specs,
    placements,
    unit_groups,
)
from ipuft.ops import WeightGradients, taking_weight_gradients
from ipuft.optim import Optimizer, StepContext
from ipuft.parallel import Layout, active
from ipuft.program import Entry, Move, Op, OpActivations, Phase, Unit


@dataclass
class StepResult:
    """What one optimizer step reports (loss and norm are global; bytes are this rank's).

    ``skipped``: the loss or gradient norm was not finite, so nothing was updated; ``loss_scale``: the
    scale this step's gradients carried.
    """

    loss: float
    grad_norm: float
    h2d_bytes: int
    d2h_bytes: int
    device_peak_bytes: int
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: bool = False
    loss_scale: float = 1.0
    activation_bytes: int = 0  # the peak bytes of buffered activations (host or device)
    variable_bytes: int = 0  # bytes of every variable this rank stores (host with offload, else device)
    graph_bytes: int = 0  # recompute=false: the peak bytes of the forward graphs kept for the backward


@dataclass
class _StepState:
    batch: Batch
    lr: float
    loss_scale: float
    norm_sq: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norm: float = float("nan")
    skip: bool = False




class _Graphs:
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


def updates_on_host(cfg: DictConfig) -> bool:
    """``execution.optimizer_placement=host``: updates run in host memory, where the variables live."""
    return cfg.execution.optimizer_placement.value == "host"


class PhasedEngine:
    """Owns the variable store and runs optimizer steps through the step program."""

    def __init__(self, cfg: DictConfig, parts: ModelParts, optimizer: Optimizer | None, device: torch.device,
                 layout: Layout | None = None, initializer: Initializer | None = None) -> None:
        """``initializer(unit, specs)`` gives a unit's full initial weights (default: random, seeded).

        Without an ``optimizer`` the engine is for inference (:mod:`ipuft.engine.inference`): it stores the weights
        only, with no optimizer state and no gradients, and cannot :meth:`step`."""
        self.cfg = cfg
        self.parts = parts
        self.program = parts.program
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.layout = layout or active()
        self.placed = placements(parts, self.layout, bool(cfg.execution.rts))
        # Each role's trainable variables: the only ones with gradients, optimizer state and updates.
        self.trainable = {role: {v.name for v in specs if v.trainable} for role, specs in parts.variables.items()}
        self.dtype = compute_dtype(cfg)
        self.recipe = recipe(cfg)
        self.host_update = updates_on_host(cfg) and optimizer is not None
        # What each phase moves (None: nothing, an update of a unit with nothing trainable): the program decides.
        self.moves = {phase: self.program.moves(phase, bool(self.trainable[phase.role]), self.host_update)
                      for phase in self.program}
        self.scale = LossScale.from_config(cfg)
        self.dropout = cfg.model.dropout_prob > 0
        self.recompute = bool(cfg.execution.recompute)
        # recompute=false: each unit's forward graphs, kept from its forward to its backward (see _forward).
        self._graphs: dict[str, _Graphs] = {}
        self.graph_bytes = self.graph_peak = 0  # their saved tensors' bytes now, and the step's peak
        if cfg.execution.retain_host_memory:
            retain_freed_memory()
        self.store = VariableStore(self.device, offload=cfg.execution.offload)
        self.buffers = ActivationBuffers(self.store, cfg.execution.activation_offload, self.layout)
        self.updates = 0  # optimizer steps taken; Adam's bias correction counts from 1
        self.modules = parts.modules
        for module in self.modules.values():
            module.train(optimizer is not None)
        self._allocate(initializer or (lambda unit, specs: initial_values(unit, specs, cfg.model.seed)))

    # ---- setup ----

    def _allocate(self, initializer: Initializer) -> None:
        """Fill the store unit by unit with the groups :func:`~ipuft.engine.variables.unit_groups` says it holds:
        the weights from ``initializer`` (one unit's full float32 weights at a time, so a rank never holds more
        besides its store; a master copy starts from them; the store keeps the weights' dtype), the optimizer
        state and the gradients allocated."""
        stores_grad = self.program.grad_units(self.host_update)
        master = self.recipe is Recipe.master
        for unit in self.program.units():
            placed = self.placed[unit.role]
            groups = unit_groups(placed, self.optimizer, master, unit in stores_grad)
            full = initializer(unit, [float32(v) for v in self.parts.variables[unit.role]])
            wide = {n: placed[n].to_stored(t) for n, t in full.items()}
            del full
            self.store.put(unit, "fwd", {s.name: wide[s.name].to(s.dtype) for s in groups["fwd"]})
            for group in ("optim", "grad"):
                if group in groups:
                    self.store.allocate(unit, group, groups[group])
            if master:
                for spec in groups["optim"]:
                    if spec.name.state == MASTER:
                        self.store.entries[unit]["optim"][spec.name].copy_(wide[spec.name.variable])

    # ---- one step ----

    def step(self, batch: Batch, lr: float) -> StepResult:
        """Run one optimizer step over this replica's ``batch`` with learning rate ``lr``."""
        if self.optimizer is None:
            raise TypeError("an inference engine (built without an optimizer) cannot take training steps")
        if batch.micro_batches != self.cfg.gradient_accumulation:
            raise ValueError(f"batch has {batch.micro_batches} micro-batches, "
                             f"expected {self.cfg.gradient_accumulation}")
        before = self.store.traffic.copy()
        self.store.ledger.reset_peak()
        self.updates += 1
        with section("copies"):
            batch = Batch(batch.input_ids.to(self.device), batch.labels.to(self.device))
        self.store.traffic.h2d["data"] += 2 * batch.tokens * batch.input_ids.element_size()
        state = _StepState(batch, lr, self.scale.scale, torch.zeros((), dtype=torch.float32, device=self.device))
        phases = self.program.phases
        profile = active_profile()
        for i, phase in enumerate(phases):
            self._prefetch(phase, phases[i + 1] if i + 1 < len(phases) else None)
            if profile is None:
                self._run(phase, state)
            else:
                with profile.phase(phase):
                    self._run(phase, state)
        activation_bytes = self.buffers.peak
        self.buffers.clear()
        graph_peak, self.graph_peak = self.graph_peak, 0
        if state.skip:
            self.updates -= 1  # Adam's bias correction counts updates that happened
        self.scale.update(overflow=state.skip)
        loss = torch.stack(state.losses).mean()
        if self.layout.data_parallel > 1:
            with section("collectives"):
                dist.all_reduce(loss, group=self.layout.dp_group)
            loss /= self.layout.data_parallel
        traffic = self.store.traffic.since(before)
        return StepResult(
            loss=loss.item(),
            grad_norm=state.grad_norm,
            h2d_bytes=traffic.h2d_bytes,
            d2h_bytes=traffic.d2h_bytes,
            device_peak_bytes=self.store.ledger.peak,
            traffic=traffic.as_dict(),
            skipped=state.skip,
            loss_scale=state.loss_scale,
            activation_bytes=activation_bytes,
            variable_bytes=self.store.variable_bytes(),
            graph_bytes=graph_peak,
        )

    def _prefetch(self, current: Phase, following: Phase | None) -> None:
        """On CUDA, start copying the next phase's variables while this phase computes."""
        moves = self.moves[following] if following is not None else None
        if moves is None or following.unit == current.unit:
            return
        for move in moves.loads:
            self.store.prefetch(following.unit, move.group, self._moving(following, move))

    def _moving(self, phase: Phase, move: Move) -> list[str]:
        """The names of the variables ``move`` moves of ``phase``'s unit."""
        return move.select(self.store.entries[phase.unit][move.group], self.trainable[phase.role])

    def _gather(self, phase: Phase, stored: Tensors) -> tuple[Tensors, int]:
        """The unit's weights in the local form to compute with, and the bytes the gather added."""
        placed = self.placed[phase.role]
        weights = {n: placed[n].gather(t) for n, t in stored.items()}
        gathered = nbytes(w for n, w in weights.items() if w is not stored[n])
        self.store.ledger.acquire(gathered)
        return weights, gathered

    def _run(self, phase: Phase, st: _StepState) -> None:
        """Run ``phase``: load what :meth:`~ipuft.program.StepProgram.moves` says it loads, run its ops, store
        what it says it stores."""
        unit, module, placed = phase.unit, self.modules[phase.role], self.placed[phase.role]
        moves = self.moves[phase]
        if moves is None:
            return
        loaded = {m.group: self.store.load(unit, m.group, self._moving(phase, m)) for m in moves.loads}
        grads = loaded.get("grad")
        weights = None
        if phase.computes:
            weights, gathered = self._gather(phase, loaded["fwd"])
        for op in phase.ops:
            if op is Op.FORWARD:
                self._forward(phase, module, weights, st.batch)
            elif op in (Op.LOSS_BACKWARD, Op.BACKWARD):
                grads = self._gradients(phase, op, module, weights, st)
                self._add_to_norm(placed, grads, st)
            elif op is Op.GLOBAL_NORM:
                if self.layout.distributed:
                    with section("collectives"):
                        dist.all_reduce(st.norm_sq)
                st.grad_norm = st.norm_sq.sqrt().item()
                # A non-finite loss makes a non-finite gradient; the norm is reduced over every rank, so
                # all of them agree to skip the update.
                st.skip = not math.isfinite(st.grad_norm)
            elif op is Op.OPTIMIZER_STEP and not st.skip and not self.host_update:
                with section("optimizer"):
                    self._optimizer_step(phase, loaded["fwd"], loaded["optim"], grads, st)
        if weights is not None:
            self.store.ledger.release(gathered)
        for move in moves.stores:
            if st.skip and move.group != "grad":
                continue  # a skipped step leaves weights and optimizer state untouched
            tensors = grads if move.group == "grad" else loaded[move.group]
            self.store.save(unit, move.group, {n: tensors[n] for n in move.select(tensors, self.trainable[phase.role])})
        if self.host_update and phase.updates and not st.skip:
            with section("optimizer"):
                self._host_step(phase, st)
        for tensors in loaded.values():
            self.store.release(tensors)
        if phase.computes_gradient and "grad" not in loaded:
            self.store.ledger.release(nbytes(grads.values()))

    def _host_step(self, phase: Phase, st: _StepState) -> None:
        """``execution.optimizer_placement=host``: update the unit where its variables live, in place in host
        memory, from its stored gradient (the phase has just stored the gradient it computed). Nothing
        crosses to the device; the weights come back when the next step's phases load them.

        A worker thread could run these updates while the device works, but in the reference's program
        nothing computes after the global norm, which every update needs: the host updates run in turn,
        each using the CPU's intra-op threads."""
        self.store.synchronize()  # the gradients' device→host copies have landed (CUDA)
        entries = self.store.entries[phase.unit]
        weights = {n: t for n, t in entries["fwd"].items() if n in self.trainable[phase.role]}
        with self.store.ledger.on_host():
            self._optimizer_step(phase, weights, entries["optim"], entries["grad"], st)

    # ---- ops ----

    def _rng(self, unit: str, mb: int):
        """The same dropout masks in a layer's forward and in its recompute; the same within a TP group,
        different across DP ranks."""
        if not self.dropout:
            return contextlib.nullcontext()
        key = (self.cfg.model.seed, self.updates, self.layout.dp_rank, zlib.crc32(unit.encode()), mb)
        seed = zlib.crc32(repr(key).encode())
        devices = [self.device] if self.device.type == "cuda" else []

        @contextlib.contextmanager
        def seeded():
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                yield

        return seeded()

    def _forward(self, phase: Phase, module: torch.nn.Module, weights: Tensors, batch: Batch) -> None:
        """Every micro-batch's forward: from the token ids (the first unit) or the entry the op reads, into
        the entry it writes; no autograd state is kept (with recompute)."""
        io = self.moves[phase].activations[Op.FORWARD]
        if not self.recompute:
            return self._forward_keeping_graphs(phase, module, weights, batch, io)
        source, (target,) = io.read("x"), io.writes
        with torch.no_grad(), bound(module, weights):
            for mb in range(batch.micro_batches):
                if source is None:
                    with self._rng(phase.unit, mb):
                        out = module(batch.input_ids[mb])
                else:
                    with self.buffers.read(*source, mb) as x, self._rng(phase.unit, mb):
                        out = module(x)
                self.buffers.write(*target, mb, out)

    def _forward_keeping_graphs(self, phase: Phase, module, weights: Tensors, batch: Batch, io: OpActivations) -> None:
        """recompute=false: run every micro-batch's forward with autograd and keep each graph (its output and
        the input leaf) until the unit's backward, which then needs no recompute. The tensors autograd saves
        stay counted on the device from here to there."""
        source, (target,) = io.read("x"), io.writes
        params, leaves = self._autograd_weights(phase, weights)
        graphs = _Graphs(leaves)
        with bound(module, params), taking_weight_gradients(graphs.taken):
            for mb in range(batch.micro_batches):
                with contextlib.ExitStack() as stack:
                    inputs, args = self._unit_input(stack, source, mb, batch.input_ids, consume=False)
                    if not inputs and not leaves:  # a frozen first unit: its backward has nothing to do
                        with torch.no_grad(), self._rng(phase.unit, mb):
                            out = module(*args)
                        graphs.append(None, [], 0)
                    else:
                        # The step's batch (token ids) lives for the whole step: not the graph's.
                        held = [*params.values(), *inputs, batch.input_ids]
                        saved = stack.enter_context(working_set(self.store, held, keep=True))
                        with self._rng(phase.unit, mb):
                            out = module(*args)
                        graphs.append(out, inputs, saved.bytes)
                        self.graph_bytes += saved.bytes
                        self.graph_peak = max(self.graph_peak, self.graph_bytes)
                self.buffers.write(*target, mb, out.detach())
        self._graphs[phase.unit] = graphs

    def _autograd_weights(self, phase: Phase, weights: Tensors) -> tuple[Tensors, Tensors]:
        """The unit's weights to bind for a forward with autograd, and the leaves among them: trainable weights
        become fresh leaves (their gradients accumulate there); frozen ones are bound as they are, without
        autograd, so no gradient is computed for them."""
        trainable = self.trainable[phase.role]
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

    def _gradients(self, phase: Phase, op: Op, module, weights: Tensors, st: _StepState) -> Tensors:
        """The gradient of the unit's trainable variables over every micro-batch, reduced over DP, in its
        stored form and its weights' dtype (16-bit weights: summed in float32, rounded once at the end)."""
        size = nbytes(w for n, w in weights.items() if n in self.trainable[phase.role])
        wide = self.dtype != torch.float32
        working = gradient_working_bytes(size, wide, st.batch.micro_batches, self.layout.data_parallel)
        self.store.ledger.acquire(working)
        local = self._backward(phase, self.moves[phase].activations[op], module, weights, st, wide)
        # Left: the sums (float32, or already rounded), or autograd's accumulated gradients.
        self.store.ledger.release(working - nbytes(local.values()))
        placed = self.placed[phase.role]
        grads = {n: placed[n].reduce_gradient(g).to(weights[n].dtype) for n, g in local.items()}
        self.store.ledger.release(nbytes(local.values()) - nbytes(grads.values()))
        return grads

    def _backward(self, phase: Phase, io: OpActivations, module, weights: Tensors, st: _StepState,
                  wide: bool) -> Tensors:
        """Loss-backward (head) or recompute-backward (decoder, embeddings) of every micro-batch; returns
        the unit's gradients summed over micro-batches: by autograd itself (into the leaves' ``.grad``), or
        with ``wide`` into float32 sums, one micro-batch's 16-bit gradient at a time.

        The weights the unit's projections compute with by :func:`ipuft.ops.linear` get their gradients taken
        later (see :mod:`ipuft.ops`): one matmul over the tokens of :func:`take_every` micro-batches at a time,
        each such gradient summed as a micro-batch's is."""
        graphs = self._graphs.pop(phase.unit, None)
        params, leaves = self._autograd_weights(phase, weights)
        if graphs is not None:
            leaves = graphs.leaves  # the kept graphs accumulate into the leaves their forward bound
        micro_batches = st.batch.micro_batches
        taken = WeightGradients(leaves.values()) if graphs is None else graphs.taken
        every = take_every(micro_batches, st.batch.input_ids[0].numel())
        names = {id(p): n for n, p in leaves.items()}
        sums: Tensors = {}

        def add(name: str, grad: torch.Tensor, index: int, count: int) -> None:
            if wide:
                sums[name] = self._sum_16bit(sums.get(name), grad, index, count)
            else:
                leaf = leaves[name]
                leaf.grad = grad if leaf.grad is None else leaf.grad.add_(grad)

        takes = -(-micro_batches // every)
        # One take is the unit's whole local gradient (in 16 bits, with no float32 sum over DP to follow): it is
        # written into the gradient this unit stored last step, which its update has consumed.
        homes = self._gradient_homes(phase) if takes == 1 and (not wide or self.layout.data_parallel == 1) else {}
        held = 0
        with bound(module, params), taking_weight_gradients(taken):
            for mb in range(micro_batches):
                if graphs is None:
                    self._backward_micro_batch(phase, io, module, list(leaves.values()), mb, st)
                else:
                    self._backward_kept_graph(io, graphs, mb, list(leaves.values()))
                if wide:
                    for n, p in leaves.items():
                        if p.grad is not None:  # made by autograd
                            add(n, p.grad, mb, micro_batches)
                            p.grad = None
                holding = storage_bytes(taken.held())  # counted as resident until taken
                self.store.ledger.acquire(holding - held)
                held = holding
                if (mb + 1) % every and mb + 1 < micro_batches:
                    continue
                for leaf, grad in taken.take(lambda leaf: homes.get(names[id(leaf)])):
                    add(names[id(leaf)], grad, mb // every, takes)
                self.store.ledger.release(held)
                held = 0
        return sums if wide else {n: p.grad for n, p in leaves.items()}

    def _gradient_homes(self, phase: Phase) -> Tensors:
        """The gradients ``phase``'s unit stored last step, where they are kept in the compute device's memory
        (a CPU device, or offload off): memory that a fresh gradient would fault in page by page on a CPU."""
        if self.store.offload and not self.store.lends:
            return {}
        return self.store.entries[phase.unit].get("grad", {})

    def _sum_16bit(self, summed: torch.Tensor | None, grad: torch.Tensor, mb: int, micro_batches: int) -> torch.Tensor:
        """Add micro-batch ``mb``'s 16-bit gradient to the sum so far (``None`` before the first): in float32,
        rounded once to 16 bits at the end. Where no float32 reduction over DP follows, the last addition is
        rounded as it is made, into the last gradient itself, and two micro-batches need no float32 sums at all:
        the same values with fewer passes over the gradients and less memory (see
        :func:`gradient_working_bytes`)."""
        chunk = gradient_chunk(self.device)
        rounded_here = self.layout.data_parallel == 1
        if summed is None:  # the first micro-batch: kept as it is where one addition at most follows
            return grad if rounded_here and micro_batches <= 2 else grad.float()
        if mb == micro_batches - 1 and rounded_here:
            add_rounded_(grad, summed, chunk)
            return grad
        add_widened_(summed, grad, chunk)
        return summed

    def _backward_micro_batch(self, phase: Phase, io: OpActivations, module, params: list[torch.Tensor], mb: int,
                              st: _StepState):
        """Run micro-batch ``mb``'s forward with gradient (the head's loss, or a recompute seeded by the ``dx``
        entry the op reads), backpropagate into ``params``, and keep the gradient of the unit's input as the
        ``dx`` entry the op writes."""
        with contextlib.ExitStack() as stack:
            inputs, args = self._unit_input(stack, io.read("x"), mb, st.batch.input_ids, consume=True)
            upstream = io.read("dx")
            if upstream is None:  # the head: loss, and the gradient that seeds the backward
                args = (*args, st.batch.labels[mb])
                seed = None
            else:
                seed = stack.enter_context(self.buffers.read(*upstream, mb, consume=True))
                stack.enter_context(recompute())  # only the gradient of this forward is used
            stack.enter_context(working_set(self.store, [*params, *inputs, st.batch.input_ids, st.batch.labels]))
            if not inputs and not params:
                return  # a frozen first unit: nothing upstream needs a gradient, nothing here is trained
            with self._rng(phase.unit, mb):
                out = module(*args)
            if seed is None:
                st.losses.append(out.detach())
                out = out * (st.loss_scale / st.batch.micro_batches)
            torch.autograd.backward(out, seed, inputs=inputs + params)
        if inputs:
            self.buffers.write(*io.written("dx"), mb, inputs[0].grad)

    def _backward_kept_graph(self, io: OpActivations, graphs: _Graphs, mb: int, leaves: list[torch.Tensor]) -> None:
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
        self.store.ledger.release(size)
        self.graph_bytes -= size
        if inputs:
            self.buffers.write(*io.written("dx"), mb, inputs[0].grad)

    def _add_to_norm(self, placed: dict[str, Placement], grads: Tensors, st: _StepState) -> None:
        """Add the squared norm of the unscaled, reduced gradient; each element counts once in the world. A
        16-bit gradient's norm is taken in float32 a chunk at a time (torch's norm with ``dtype`` converts the
        whole tensor first: 0.8 GB for a GPT-J-6B-wide head)."""
        counted = [g for name, g in grads.items() if placed[name].norm_weight()]
        if not counted:
            return
        with torch.no_grad():
            if self.dtype == torch.float32:
                norms = torch.stack(torch._foreach_norm(counted))
            else:
                norms = torch.stack([chunked_norm(g, gradient_chunk(g.device)) for g in counted])
            st.norm_sq += norms.square().sum() / st.loss_scale**2

    def _optimizer_step(self, phase: Phase, weights: Tensors, optim: Tensors, grads: Tensors, st: _StepState):
        """Finish every gradient of the unit (the loss scale removed, global-norm clipping applied, in float32)
        and hand it to the optimizer (the optimizer contract, :mod:`ipuft.optim`), piece by piece.

        An elementwise optimizer gets the unit's variables cut into pieces of at most :func:`update_chunk`
        elements, grouped so that each call updates about that many: the update's temporaries (the
        optimizer's own, the float32 views of 16-bit weights, the rounding's) stay that small, where the
        whole of a GPT-J-6B-wide embedding would make each of them 0.8 GB, and on the CPU the working set of
        one call stays in cache. Each element's arithmetic is the same, so the results are those of one call
        over whole variables. Any other optimizer gets whole variables, one at a time."""
        clipping = self.cfg.training.optimizer.gradient_clipping
        factor = (1.0 / st.loss_scale) * clipping / max(st.grad_norm, clipping)
        ctx = StepContext(lr=st.lr, step=self.updates, global_norm=st.grad_norm, grad_factor=factor)
        states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in weights}
        for key, t in optim.items():
            states[key.variable][key.state] = t
        sizes = [(name, weights[name].numel()) for name in weights if name in grads]  # frozen: no gradient
        device = next(iter(weights.values())).device if weights else self.device
        chunk = update_chunk(device) if getattr(self.optimizer, "elementwise", True) else None
        for group in update_groups(sizes, chunk):
            self._update_group(phase, group, weights, grads, states, ctx)

    def _update_group(self, phase: Phase, group: list[tuple[str, int, int]], weights: Tensors, grads: Tensors,
                      states: dict[str, dict[str, torch.Tensor]], ctx: StepContext) -> None:
        """One optimizer call over ``group``'s pieces ``(variable, start, stop)`` of flat elements. The optimizer
        sees float32: a 16-bit weight's view is its master copy or a float32 copy, mapped back into the weight
        by the run's recipe (see :mod:`ipuft.engine.precision`). Stored gradients are consumed: a float32 one is
        finished in place."""
        def piece(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            return t.view(-1)[start:stop]

        wide = self.recipe is not Recipe.exact
        transient = group_transient_bytes(self.recipe, [stop - start for _, start, stop in group])
        self.store.ledger.acquire(transient)
        names, views, finished, pieces = [], [], [], []
        for name, start, stop in group:
            state = {k: piece(t, start, stop) for k, t in states[name].items()}
            master = state.pop(MASTER, None)
            weight = piece(weights[name], start, stop)
            names.append(f"{phase.unit}.{name}")
            views.append(weight if not wide else master if master is not None else weight.float())
            finished.append(piece(grads[name], start, stop).float())
            pieces.append(state)
        torch._foreach_mul_(finished, ctx.grad_factor)
        self.optimizer.step_unit(names, views, finished, pieces, ctx)
        if wide:
            for (name, start, stop), view in zip(group, views):
                self._round_into(phase, name, piece(weights[name], start, stop), view, start, ctx.step)
        self.store.ledger.release(transient)

    def _round_into(self, phase: Phase, name: str, weight: torch.Tensor, view: torch.Tensor, start: int,
                    step: int) -> None:
        """Map the updated float32 ``view`` back into the 16-bit ``weight`` (elements ``start …`` of the
        variable's stored form) by the run's recipe: stochastic rounding keyed on each element's index in the
        full variable, or to nearest (a master copy is cast, as it is)."""
        if self.recipe is not Recipe.stochastic:
            weight.copy_(view)
            return
        key = rounding_key(self.cfg.model.seed, phase.unit, name, step)
        placed = self.placed[phase.role][name]
        stochastic_round_(weight, view, key, lambda first, count: placed.counters(start + first, count, weight.device))

    # ---- whole-model views ----

    def weights(self) -> dict[str, Tensors]:
        """Every unit's weights as this rank stores them (host tensors when offloaded)."""
        return self.store.state("fwd")

    def _placement(self, unit: Unit, group: str, name: str) -> Placement:
        """The placement of ``name`` in ``group``; optimizer state (a :class:`~ipuft.engine.variables.StateName`)
        is placed like its variable."""
        return self.placed[unit.role][name.variable if group == "optim" else name]

    def full_specs(self, unit: Unit, group: str = "fwd") -> list[VariableSpec]:
        """The full (layout-free) specs of ``unit``'s ``group`` (``fwd`` or ``optim``) in their stored dtypes,
        in the order :meth:`full_tensors` gives them (and checkpoints hold them)."""
        variables = self.parts.variables[unit.role]
        if group == "fwd":
            return list(variables)
        return optimizer_state_specs(variables, self.optimizer, self.recipe is Recipe.master)

    def full_tensors(self, groups: Sequence[str] = ("fwd",)) -> Iterator[tuple[Unit, str, VariableSpec, torch.Tensor]]:
        """Every unit's full variables of ``groups`` as ``(unit, group, full spec, tensor)``, one at a time:
        units in program order, each unit's groups in turn, each in :meth:`full_specs` order.

        Each tensor is gathered over DP and TP only when it is reached, so a rank holds about one full tensor
        beyond its store at a time. Every rank must exhaust the iterator, in step: each tensor is a collective.
        A variable no rank shares comes back as stored (no copy on CPU): use it before the next step.
        """
        self.store.synchronize()
        for unit in self.program.units():
            for group in groups:
                stored = self.store.entries[unit][group]
                for spec in self.full_specs(unit, group):
                    placement = self._placement(unit, group, spec.name)
                    tensor = stored[spec.name]
                    if placement.collective:
                        tensor = placement.full(tensor.to(self.device))
                    yield unit, group, spec, tensor.cpu()

    def full_weights(self, group: str = "fwd") -> dict[str, Tensors]:
        """Every unit's full weights (or, with ``group="optim"``, optimizer state, named
        ``<variable>.<state>``), gathered over DP and TP, as copies. Every rank must call it."""
        out: dict[str, Tensors] = {}
        for unit, _, spec, tensor in self.full_tensors([group]):
            stored = self.store.entries[unit][group][spec.name]
            out.setdefault(unit, {})[spec.name] = tensor.clone() if tensor is stored else tensor
        return out

    def load_full(self, group: str, units: dict[Unit, Tensors]) -> None:
        """Replace ``group`` of every unit from full tensors (a checkpoint's), in this rank's stored form."""
        for unit, tensors in units.items():
            stored = self.store.entries[unit][group]
            for n, t in tensors.items():
                if t is not stored[n]:  # else read into place already (see full_homes)
                    stored[n].copy_(self._placement(unit, group, n).to_stored(t))

    def full_homes(self, unit: Unit, group: str) -> Tensors:
        """The stored tensors of ``unit``'s ``group`` that are their full variable (no rank shares them) and
        live in host memory: a checkpoint can be read straight into them."""
        return {n: t for n, t in self.store.entries[unit][group].items()
                if not self._placement(unit, group, n).collective and t.device.type == "cpu" and t.is_contiguous()}
