"""The phased execution engine: runs the step program, phase by phase, over every micro-batch.

Each phase brings one unit's variables to the compute device, loops over all gradient-accumulation
micro-batches (layer-major batch serialisation, :mod:`ipuft.engine.compute`), and stores back what it changed.
The global gradient norm gathers every unit's gradient before any optimizer step runs, as in the reference's
``finetuning()``; then each unit's trainable variables are updated together (:mod:`ipuft.engine.update`).
Frozen variables get no gradient and no update. The variables themselves are a
:class:`~ipuft.engine.stored.StoredModel`'s; this module is the schedule only.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ipuft.components import IGNORE_INDEX
from ipuft.data.batch import Batch
from ipuft.engine.activations import ActivationBuffers, Spill
from ipuft.engine.compute import UnitCompute
from ipuft.engine.cuts import step_shape
from ipuft.engine.gradients import squared_norm
from ipuft.engine.model import ModelParts
from ipuft.engine.placement import Placement
from ipuft.engine.scaling import LossScale
from ipuft.engine.sliced import finish_tables
from ipuft.engine.spill import spill_root, spilled_rows
from ipuft.engine.state import StepState
from ipuft.engine.store import Tensors
from ipuft.engine.stored import StoredModel
from ipuft.engine.streaming import StreamedUpdate
from ipuft.engine.update import UnitUpdate
from ipuft.engine.variables import Initializer
from ipuft.optim import Optimizer
from ipuft.parallel import Layout
from ipuft.preference import PreferenceLoss, metrics, summed
from ipuft.profiling import active as active_profile
from ipuft.profiling import section
from ipuft.program import Move, Op, Phase


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
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)  # each phase's peak above what it found
    spill_written_bytes: int = 0  # activation_offload=disk: bytes of activations written to disk this step
    spill_read_bytes: int = 0  # and read back
    metrics: dict[str, float] = field(default_factory=dict)  # preference data: TRL's rewards and log-probs


def token_weights(labels: torch.Tensor, layout: Layout | None = None) -> list[float]:
    """Each micro-batch's weight in the step's loss, ``n_mb · DP / n``: ``n_mb`` its trained tokens (labels not
    ``IGNORE_INDEX``), ``n`` the step's over every micro-batch and DP rank (one all-reduce of a count). The step's
    loss is then the mean over all its trained tokens (transformers' Trainer, TRL), and a micro-batch of few
    trained tokens weighs as little as it holds, and one with none weighs nothing (its loss, the mean over no
    tokens, is 0 with a zero gradient: :func:`ipuft.parallel.vocab_parallel_head`). Equal counts give ``1 / GA``
    exactly. No trained token in the whole step: NaN each, so that the loss and the gradients are not numbers
    and the step is skipped as any such step is."""
    counts = (labels != IGNORE_INDEX).flatten(1).sum(1)
    total = counts.sum()
    dp = layout.data_parallel if layout is not None else 1
    if dp > 1:
        with section("collectives"):
            dist.all_reduce(total, group=layout.dp_group)
    n = int(total)
    if n == 0:
        return [math.nan] * labels.shape[0]
    return [int(c) * dp / n for c in counts.tolist()]


def micro_batch_positions(batch: Batch) -> list[torch.Tensor | None]:
    """Each micro-batch's ``positions[mb]`` (:class:`~ipuft.data.batch.Batch`), or ``None`` where every row of
    it is one example (0, 1, ...: the plain causal attention, with no mask). Raises ``ValueError`` for positions
    that are not ``input_ids``' shape in int64, or whose rows do not start at 0 and count up by one within an
    example."""
    if batch.positions is None:
        return [None] * batch.micro_batches
    p = batch.positions
    if p.shape != batch.input_ids.shape or p.dtype != torch.int64:
        raise ValueError(f"batch positions {tuple(p.shape)} {p.dtype}: expected input_ids' shape "
                         f"{tuple(batch.input_ids.shape)}, int64")
    steps = (p[..., 1:] == 0) | (p[..., 1:] == p[..., :-1] + 1)
    if not (bool((p[..., 0] == 0).all()) and bool(steps.all())):
        raise ValueError("batch positions: each row starts at 0, and each next token is 0 (a new example) "
                         "or one more than the token before")
    plain = (p == torch.arange(p.shape[-1], device=p.device)).flatten(1).all(-1).tolist()
    return [None if one else p[mb] for mb, one in enumerate(plain)]


class PhasedEngine:
    """Runs optimizer steps of a :class:`StoredModel` through its step program."""

    def __init__(self, cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, device: torch.device,
                 layout: Layout | None = None, initializer: Initializer | None = None) -> None:
        """Store the model (``initializer(unit, specs)`` gives a unit's full initial weights; default: random,
        seeded) with ``optimizer``'s state, and prepare its step program. For forward passes only, build a
        :class:`StoredModel` without an optimizer instead."""
        if optimizer is None:
            raise TypeError("a training engine needs an optimizer; a model for forward passes only is a "
                            "StoredModel built without one")
        self.model = StoredModel(cfg, parts, device, layout, optimizer, initializer)
        self.cfg, self.parts, self.program, self.optimizer = cfg, parts, parts.program, optimizer
        self.device, self.layout, self.store, self.modules = (self.model.device, self.model.layout,
                                                              self.model.store, self.model.modules)
        self.trainable = self.model.trainable
        self.host_update = self.model.host_update
        # What each phase moves (None: nothing, an update of a unit with nothing trainable): the program decides.
        self.moves = {phase: self.program.moves(phase, bool(self.trainable[phase.role]), self.host_update)
                      for phase in self.program}
        self.scale = LossScale.from_config(cfg)
        self.preference = PreferenceLoss.of(cfg)  # data.format=preference: the pairs' loss, in the head
        self.shape = step_shape(cfg)
        self.buffers = ActivationBuffers(self.store, cfg.execution.activation_offload, self.layout, self._spill())
        self.compute = UnitCompute(self.model, self.buffers)
        self.update = UnitUpdate(self.model)
        # The groups each update streams to the device piece by piece rather than loading them whole.
        self.streamed = {phase: self.shape.streamed_groups(phase, self.moves[phase]) for phase in self.program}
        for phase, moves in self.moves.items():  # a table's gradient in host memory: the unit's only one
            tied = {t.variable for t in moves.carries} if moves is not None else set()
            if "grad" in self.streamed[phase] and tied and set(self.trainable[phase.role]) - tied:
                raise ValueError(f"execution.head_vocab_slices: unit {phase.unit} trains "
                                 f"{sorted(set(self.trainable[phase.role]) - tied)} besides its tied table; "
                                 "set execution.head_vocab_slices=0")
        self.streaming = StreamedUpdate(self.update)
        self.updates = 0  # optimizer steps taken; Adam's bias correction counts from 1

    # ---- one step ----

    def step(self, batch: Batch, lr: float) -> StepResult:
        """Run one optimizer step over this replica's ``batch`` with learning rate ``lr``."""
        if batch.micro_batches != self.cfg.gradient_accumulation:
            raise ValueError(f"batch has {batch.micro_batches} micro-batches, "
                             f"expected {self.cfg.gradient_accumulation}")
        before = self.store.traffic()
        self.store.begin_step()
        self.updates += 1
        with section("copies"):
            positions = micro_batch_positions(batch)  # checked where the batch is (the host's, in a run)
            if (batch.reference is None) != (self.preference is None):
                raise ValueError("a batch of preference data (with reference log-probs) is for a run with "
                                 "data.format=preference, and that run's batches must have them")
            batch = Batch(*(None if t is None else t.to(self.device)
                            for t in (batch.input_ids, batch.labels, batch.positions, batch.reference)))
            positions = [None if p is None else batch.positions[mb] for mb, p in enumerate(positions)]
        moved = (batch.input_ids, batch.labels, batch.positions, batch.reference)
        self.store.brought("data", sum(t.numel() * t.element_size() for t in moved if t is not None), held=False)
        # Preference data: micro-batches of equal pairs weigh 1 / GA each (the step's loss the mean over pairs).
        state = StepState(batch, lr, self.scale.scale, self.updates,
                          torch.zeros((), dtype=torch.float32, device=self.device), positions=positions,
                          weights=[] if self.preference else token_weights(batch.labels, self.layout),
                          preference=self.preference)
        phases = self.program.phases
        profile = active_profile()
        for i, phase in enumerate(phases):
            self._prefetch(phase, phases[i + 1] if i + 1 < len(phases) else None)
            with self.store.phase(phase.name), \
                    (profile.phase(phase) if profile is not None else contextlib.nullcontext()):
                self._run(phase, state)
        activation_bytes = self.buffers.peak
        written, read = self.buffers.spilled_bytes()
        self.buffers.clear()
        graph_peak = self.compute.end_step()
        if state.skip:
            self.updates -= 1  # Adam's bias correction counts updates that happened
        self.scale.update(overflow=state.skip)
        # The step's loss: the mean over every trained token of the step (each micro-batch's mean by its weight).
        weights = torch.tensor([state.weight(mb) for mb in range(batch.micro_batches)], dtype=torch.float32,
                               device=self.device)
        loss = (torch.stack(state.losses).float() * weights).sum()
        pair_sums = summed([r for sums in state.pair_sums for r in sums], self.device) if self.preference else None
        if self.layout.data_parallel > 1:
            with section("collectives"):
                dist.all_reduce(loss, group=self.layout.dp_group)
                if pair_sums is not None:
                    dist.all_reduce(pair_sums, group=self.layout.dp_group)
            loss /= self.layout.data_parallel
        traffic = self.store.traffic().since(before)
        peak, phase_peaks = self.store.step_peaks()
        return StepResult(
            loss=loss.item(),
            grad_norm=state.grad_norm,
            h2d_bytes=traffic.h2d_bytes,
            d2h_bytes=traffic.d2h_bytes,
            device_peak_bytes=peak,
            traffic=traffic.as_dict(),
            skipped=state.skip,
            loss_scale=state.loss_scale,
            activation_bytes=activation_bytes,
            variable_bytes=self.store.variable_bytes(),
            graph_bytes=graph_peak,
            phase_peak_bytes=phase_peaks,
            spill_written_bytes=written,
            spill_read_bytes=read,
            metrics=metrics(pair_sums) if pair_sums is not None else {},
        )

    def _spill(self) -> Spill | None:
        """What ``activation_offload=disk`` spills, and where (:func:`ipuft.engine.spill.spill_root`; a training
        run names its run directory for ``output_dir`` once it has made it)."""
        if not self.shape.spills:
            return None
        root = spill_root(self.cfg.execution.spill_dir, self.cfg.output_dir)
        rows = spilled_rows(m.activations for m in self.moves.values() if m is not None)
        return Spill(Path(root), frozenset(rows), self.cfg.gradient_accumulation, self.shape.spill_bytes,
                     self.layout.rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def close(self) -> None:
        """Release what the engine holds outside memory: its activation spill directory, if any."""
        self.buffers.close()

    def _prefetch(self, current: Phase, following: Phase | None) -> None:
        """On CUDA, start copying the next phase's variables while this phase computes."""
        moves = self.moves[following] if following is not None else None
        if moves is None or following.unit == current.unit:
            return
        for move in moves.loads:
            if move.group not in self.streamed[following]:
                self.store.prefetch(following.unit, move.group, self._moving(following, move))

    def _moving(self, phase: Phase, move: Move) -> list[str]:
        """The names of the variables ``move`` moves of ``phase``'s unit."""
        return move.select(self.store.entries[phase.unit][move.group], self.trainable[phase.role])

    def _run(self, phase: Phase, st: StepState) -> None:
        """Run ``phase``: load what :meth:`~ipuft.program.StepProgram.moves` says it loads, run its ops, store
        what it says it stores."""
        moves = self.moves[phase]
        if moves is None:
            return
        streamed = self.streamed[phase]
        loaded = {m.group: self.store.load(phase.unit, m.group, self._moving(phase, m)) for m in moves.loads
                  if m.group not in streamed}
        # Tied variables: the owners' weights the unit computes with, and the other uses' gradients it adds.
        borrowed = self.model.borrow(phase.role) if moves.borrows else {}
        carried = self.store.load(phase.unit, "grad", [t.variable for t in moves.carries]) \
            if moves.carries and "grad" not in streamed else {}  # (streamed: it stays in host memory)
        grads = loaded.get("grad")
        if phase.computes:
            with self.model.gathered(phase.role, {**loaded["fwd"], **borrowed}) as weights:
                grads = self._ops(phase, weights, loaded, grads, st, carried)
        else:
            grads = self._ops(phase, None, loaded, grads, st, carried)
        for move in moves.stores:
            if (st.skip and move.group != "grad") or move.group in streamed:
                continue  # a skipped step leaves weights and optimizer state untouched; streamed: stored already
            tensors = grads if move.group == "grad" else loaded[move.group]
            self.store.save(phase.unit, move.group,
                            {n: tensors[n] for n in move.select(tensors, self.trainable[phase.role])})
        if self.host_update and phase.updates and not st.skip:
            with section("optimizer"):
                self.update.in_host_memory(phase, self._update_context(st))
        for tensors in [*loaded.values(), borrowed, carried]:
            self.store.release(tensors)
        if phase.computes_gradient and "grad" not in loaded:
            self.compute.release(phase)

    def _ops(self, phase: Phase, weights: Tensors | None, loaded: dict[str, Tensors], grads: Tensors | None,
             st: StepState, carried: Tensors) -> Tensors | None:
        """Run ``phase``'s ops in order; returns the unit's gradients (computed here, or loaded). The gradients
        of tied variables the unit uses go into their owners' stored gradients as they are made; the owner
        counts them in the norm and updates them."""
        moves = self.moves[phase]
        io = moves.activations
        for op in phase.ops:
            if op is Op.FORWARD:
                self.compute.forward(phase, io[op], weights, st)
            elif op in (Op.LOSS_BACKWARD, Op.BACKWARD):
                grads = self.compute.gradients(phase, io[op], weights, st, carried)
                if moves.carries and "grad" in self.streamed[phase]:  # tied tables' gradients, in host memory
                    grads.update(finish_tables(self.model, phase))
                for tie in moves.lends:  # (one made by vocabulary slices is stored already: ipuft.engine.sliced)
                    if tie.name in grads:
                        self.store.save(tie.owner, "grad", {tie.variable: grads.pop(tie.name)})
                self._add_to_norm(self.model.placed[phase.role], grads, st)
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
                    self._optimizer_step(phase, loaded, grads, st)
        return grads

    def _optimizer_step(self, phase: Phase, loaded: dict[str, Tensors], grads: Tensors | None, st: StepState) -> None:
        """Update ``phase``'s unit on the device: from its groups loaded whole, or streamed piece by piece
        (:mod:`ipuft.engine.streaming`)."""
        streamed = self.streamed[phase]
        if not streamed:
            self.update.step(phase, loaded["fwd"], loaded["optim"], grads, self._update_context(st))
            return
        stored = self.store.entries[phase.unit]
        fwd = next(m for m in self.moves[phase].loads if m.group == "fwd")
        with_grad = stored["grad"] if grads is None else grads
        names = [n for n in self._moving(phase, fwd) if n in with_grad]  # frozen: no gradient
        self.streaming.run(phase, streamed, names, loaded.get("fwd"), grads, self._update_context(st))

    def _update_context(self, st: StepState):
        return self.update.context(st.lr, self.updates, st.grad_norm, st.loss_scale)

    def _add_to_norm(self, placed: dict[str, Placement], grads: Tensors, st: StepState) -> None:
        """Add the squared norm of the unscaled, reduced gradient; each element counts once in the world."""
        counted = [g for name, g in grads.items() if placed[name].norm_weight()]
        if counted:
            with torch.no_grad():
                st.norm_sq += squared_norm(counted) / st.loss_scale**2
