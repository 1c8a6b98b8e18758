"""The step program: the fixed sequence of phases that makes one optimizer step, and what each phase moves.

Core emits each role's standard phases (:func:`emit_standard_phases`, the reference's); a plugin that needs
others emits them through the ``ipuft_emit_phases`` hook instead. A phase brings one unit
(the embeddings, one decoder layer, or the head) to the compute device, runs its ops over every
gradient-accumulation micro-batch (layer-major batch serialisation), and stores back what it changed.
The engine interprets the ops; the program says what runs, in which order, and what each phase moves:
:meth:`StepProgram.moves` is the one place that decides which variable groups a phase loads and stores and
which activation entries each of its ops reads and writes. The engine executes it, and ``ipuft plan`` sums
it, so the engine's counters equal the plan by construction.

A unit may compute with a variable another unit owns (:class:`Tie`: tied embeddings, where the head's
projection is the embeddings' table). The variable is stored, normed and updated once, by its owner: the user's
computing phases load it from the owner, the user's gradient phase writes its part of the gradient into the
owner's stored gradient, and the owner's gradient phase, which must come later, adds its own part to it.

Phases are emitted into :class:`Stage` slots, so the reference's order holds whatever order the plugins'
hooks are called in. :meth:`StepProgram.validate` checks the dataflow: every activation a phase reads
was written before it, the global gradient norm is finished exactly once after every gradient and before
any optimizer step, and every unit is updated exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum, IntEnum

from ipuft.errors import PluginError


class Stage(IntEnum):
    """The reference's seven stages of one optimizer step, in order."""

    EMBEDDINGS_FORWARD = 1
    DECODER_FORWARD = 2
    HEAD_FORWARD_BACKWARD = 3
    DECODER_BACKWARD = 4
    EMBEDDINGS_BACKWARD_OPTIMIZER = 5
    DECODER_OPTIMIZER = 6
    HEAD_OPTIMIZER = 7


class Unit(str):
    """A unit of the model, what a phase brings to the device: ``embeddings``, ``decoder.<n>`` or ``head``.

    Its ``role`` and ``layer`` are attributes, never parsed back from the name; and it *is* its name (a
    ``str``) wherever a name is used: variable-store keys, checkpoint tensor names (``<unit>.<variable>``),
    the keys of derived seeds.
    """

    role: str
    layer: int | None

    def __new__(cls, role: str, layer: int | None = None) -> Unit:
        unit = super().__new__(cls, role if layer is None else f"{role}.{layer}")
        unit.role, unit.layer = role, layer
        return unit

    def __reduce__(self):
        return Unit, (self.role, self.layer)


class Op(str, Enum):
    """What a phase does with its unit, for every micro-batch where it computes."""

    FORWARD = "forward"  # x[out][mb] = unit(x[in][mb]); no autograd state is kept
    LOSS_BACKWARD = "loss_backward"  # head: loss of x[L][mb], backward to dx[L][mb], accumulate grads
    BACKWARD = "backward"  # recompute from x[in][mb], backward with dx[out][mb] to dx[in][mb], accumulate
    GLOBAL_NORM = "global_norm"  # finish the global gradient norm over every variable
    OPTIMIZER_STEP = "optimizer_step"  # update weights and optimizer state from the gradient

    def __str__(self) -> str:
        return self.value


_GRADIENT_OPS = (Op.LOSS_BACKWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Phase:
    """One phase: a unit (``role``, and ``layer`` for the decoder) and the ops run on it, in order."""

    role: str
    layer: int | None
    ops: tuple[Op, ...]

    @property
    def unit(self) -> Unit:
        """The phase's unit: ``embeddings``, ``decoder.3`` or ``head``."""
        return Unit(self.role, self.layer)

    @property
    def name(self) -> str:
        return f"{self.unit}:{'+'.join(op.value for op in self.ops)}"

    @property
    def computes_gradient(self) -> bool:
        return any(op in _GRADIENT_OPS for op in self.ops)

    @property
    def computes(self) -> bool:
        """Runs the unit on micro-batches (forward, or a backward), so needs its weights in compute form."""
        return any(op in (Op.FORWARD, *_GRADIENT_OPS) for op in self.ops)

    @property
    def loads(self) -> tuple[str, ...]:
        """The variable groups brought to the device: ``fwd``, ``optim``, ``grad``."""
        groups = ["fwd"] if self.ops != (Op.GLOBAL_NORM,) else []
        if Op.OPTIMIZER_STEP in self.ops:
            groups.append("optim")
            if not self.computes_gradient:
                groups.append("grad")
        return tuple(groups)

    @property
    def stores(self) -> tuple[str, ...]:
        """The variable groups written back to host memory."""
        if Op.OPTIMIZER_STEP in self.ops:
            return ("fwd", "optim")
        if self.computes_gradient:
            return ("grad",)
        return ()

    @property
    def updates(self) -> bool:
        """Runs an optimizer step on its unit."""
        return Op.OPTIMIZER_STEP in self.ops


GROUPS = ("fwd", "optim", "grad")  # a unit's variables: weights, optimizer state, gradients


@dataclass(frozen=True)
class Move:
    """One group of a unit's variables crossing between host memory and the device: all of them, or with
    ``trainable_only`` only the trainable ones (an update's weights: frozen ones neither come nor go)."""

    group: str
    trainable_only: bool = False

    def select(self, names: Iterator[str] | dict, trainable: set[str] | frozenset[str]) -> list[str]:
        """Which of ``names`` (a group's variables, in order) move."""
        return [n for n in names if not self.trainable_only or n in trainable]


Entry = tuple[str, int]  # an activation buffer entry: ("x" or "dx", row)


@dataclass(frozen=True)
class OpActivations:
    """The activation entries one op reads and writes, for each micro-batch."""

    reads: tuple[Entry, ...]
    writes: tuple[Entry, ...]

    def read(self, kind: str) -> Entry | None:
        """The entry of ``kind`` (``x`` or ``dx``) the op reads, if any."""
        return next((e for e in self.reads if e[0] == kind), None)

    def written(self, kind: str) -> Entry | None:
        """The entry of ``kind`` the op writes, if any."""
        return next((e for e in self.writes if e[0] == kind), None)


@dataclass(frozen=True)
class Tie:
    """Variable ``name`` of the units of ``role`` is ``owner``'s variable ``variable`` (``trainable``: the
    owner trains it). Its one gradient is the sum of every use's."""

    role: str
    name: str
    owner: Unit
    variable: str
    trainable: bool = True


@dataclass(frozen=True)
class PhaseMoves:
    """What one phase moves: the variable groups it loads and stores, and each op's activation entries; and of
    tied variables, the owners' weights it borrows (``borrows``, loaded as ``fwd``), the gradients it writes
    into their owners' stored gradients (``lends``, stored as ``grad``), and, in the owner's gradient phase,
    the other uses' gradients it adds to its own (``carries``, loaded as ``grad``)."""

    loads: tuple[Move, ...]
    stores: tuple[Move, ...]
    activations: dict[Op, OpActivations]
    borrows: tuple[Tie, ...] = ()
    lends: tuple[Tie, ...] = ()
    carries: tuple[Tie, ...] = ()

    @property
    def activation_reads(self) -> int:
        """Entries read per micro-batch, over the phase's ops."""
        return sum(len(a.reads) for a in self.activations.values())

    @property
    def activation_writes(self) -> int:
        return sum(len(a.writes) for a in self.activations.values())


def op_activations(op: Op, x_in: int | None, x_out: int | None) -> OpActivations:
    """The entries an op of a unit with activation rows ``(x_in, x_out)`` reads and writes: a forward reads its
    input (none for the first unit) and writes its output; the head's loss-backward reads its input and
    writes its gradient; a backward reads its input (for the recompute; none for the first unit) and its
    output's gradient, and writes its input's gradient (none for the first unit)."""
    before = (("x", x_in),) if x_in is not None else ()
    if op is Op.FORWARD:
        return OpActivations(before, (("x", x_out),))
    if op is Op.LOSS_BACKWARD:
        return OpActivations(before, (("dx", x_in),))
    if op is Op.BACKWARD:
        return OpActivations((*before, ("dx", x_out)), (("dx", x_in),) if x_in is not None else ())
    return OpActivations((), ())


class StepProgram:
    """The phases of one optimizer step for a model of ``layers`` decoder layers."""

    def __init__(self, layers: int, ties: tuple[Tie, ...] = ()) -> None:
        self.layers = layers
        self.ties = tuple(ties)
        self._emitted: list[tuple[Stage, int, Phase]] = []

    def used_ties(self, role: str) -> tuple[Tie, ...]:
        """The tied variables the units of ``role`` compute with and do not own."""
        return tuple(t for t in self.ties if t.role == role)

    def owned_ties(self, unit: str) -> tuple[Tie, ...]:
        """The tied variables ``unit`` owns and other units use, that are trained (so have gradients)."""
        return tuple(t for t in self.ties if t.owner == unit and t.trainable)

    def emit(self, stage: Stage, phase: Phase) -> None:
        """Append ``phase`` to ``stage``; phases of one stage keep the order they were emitted in."""
        if phase.layer is not None and not 0 <= phase.layer < self.layers:
            raise PluginError(f"phase {phase.name} names layer {phase.layer} of a {self.layers}-layer model")
        self._emitted.append((Stage(stage), len(self._emitted), phase))

    @property
    def phases(self) -> list[Phase]:
        return [p for _, _, p in sorted(self._emitted, key=lambda e: (e[0], e[1]))]

    def __iter__(self) -> Iterator[Phase]:
        return iter(self.phases)

    def __len__(self) -> int:
        return len(self._emitted)

    def stage_of(self, phase: Phase) -> Stage:
        return next(s for s, _, p in self._emitted if p is phase)

    def units(self) -> list[Unit]:
        """Every unit of the model: the embeddings, each decoder layer, the head."""
        return [Unit("embeddings"), *(Unit("decoder", n) for n in range(self.layers)), Unit("head")]

    def moves(self, phase: Phase, trainable: bool, host_update: bool = False) -> PhaseMoves | None:
        """What ``phase`` moves (``trainable``: whether its unit has trainable variables), or ``None`` for a
        phase that does nothing (an update of a unit with nothing trainable).

        Loads and stores are the phase's :attr:`~Phase.loads` and :attr:`~Phase.stores`: a phase that only
        updates loads only the trainable weights, and only updated (trainable) weights are stored back. With
        ``host_update`` (``execution.optimizer_placement=host``) the host updates the stored weights and
        optimizer state in place from the stored gradient: an update-only phase moves nothing, and one that
        computes the gradient it updates with (the embeddings') loads only its weights and stores that
        gradient.
        """
        if not phase.computes and not trainable:
            return None
        loads, stores = phase.loads, phase.stores
        if host_update and phase.updates:
            loads, stores = ("fwd",) if phase.computes else (), ("grad",) if phase.computes_gradient else ()
        rows = self.activation_rows(phase)
        used = self.used_ties(phase.role) if phase.computes else ()
        return PhaseMoves(
            loads=tuple(Move(g, trainable_only=g == "fwd" and not phase.computes) for g in loads),
            stores=tuple(Move(g, trainable_only=g == "fwd") for g in stores),
            activations={op: op_activations(op, *rows) for op in phase.ops},
            borrows=used,
            lends=tuple(t for t in used if t.trainable and phase.computes_gradient),
            carries=self.owned_ties(phase.unit) if phase.computes_gradient else (),
        )

    def grad_units(self, host_update: bool = False) -> set[Unit]:
        """The units whose gradients are stored between their backward and their optimizer step (with
        ``host_update``, every unit whose gradient is computed: see :meth:`moves`)."""
        return self._own_grad_units(host_update) | {t.owner for t in self.ties if t.trainable}

    def _own_grad_units(self, host_update: bool) -> set[Unit]:
        return {p.unit for p in self.phases if p.computes_gradient
                and any(m.group == "grad" for m in self.moves(p, True, host_update).stores)}

    def tied_gradients(self, host_update: bool = False) -> dict[Unit, tuple[str, ...]]:
        """The units that store a gradient only because other units use their variables (their own gradient
        is used at once, in the phase that computes it): the tied variables whose gradients they store."""
        own = self._own_grad_units(host_update)
        out: dict[Unit, tuple[str, ...]] = {}
        for tie in self.ties:
            if tie.trainable and tie.owner not in own:
                out[tie.owner] = (*out.get(tie.owner, ()), tie.variable)
        return out

    def activation_rows(self, phase: Phase) -> tuple[int | None, int | None]:
        """The rows of ``x``/``dx`` a phase's unit reads and writes: (input row, output row).

        Row ``n`` holds the input of decoder layer ``n``; row ``L`` is the head's input. The embeddings
        read token ids (input ``None``); the head writes only a loss (output ``None``).
        """
        if phase.role == "embeddings":
            return None, 0
        if phase.role == "head":
            return self.layers, None
        return phase.layer, phase.layer + 1

    def validate(self) -> None:
        """Check the program's dataflow; raise :class:`PluginError` naming the first faulty phase."""
        x_ready: set[int] = set()
        dx_ready: set[int] = set()
        grads: set[str] = set()
        updated: set[str] = set()
        norm_done = False
        for phase in self.phases:
            x_in, x_out = self.activation_rows(phase)
            for op in phase.ops:
                if op is Op.FORWARD:
                    _need(x_in is None or x_in in x_ready, phase, f"x[{x_in}] has not been computed")
                    x_ready.add(x_out)
                elif op is Op.LOSS_BACKWARD:
                    _need(x_in in x_ready, phase, f"x[{x_in}] has not been computed")
                    dx_ready.add(x_in)
                    grads.add(phase.unit)
                elif op is Op.BACKWARD:
                    _need(x_out in dx_ready, phase, f"dx[{x_out}] has not been computed")
                    _need(not norm_done, phase, "a gradient is computed after the global norm")
                    if x_in is not None:
                        dx_ready.add(x_in)
                    grads.add(phase.unit)
                elif op is Op.GLOBAL_NORM:
                    _need(not norm_done, phase, "the global norm is finished twice")
                    missing = sorted(set(self.units()) - grads)
                    _need(not missing, phase, f"the global norm misses the gradients of {missing}")
                    norm_done = True
                elif op is Op.OPTIMIZER_STEP:
                    _need(norm_done, phase, "an optimizer step runs before the global norm")
                    _need(phase.unit not in updated, phase, f"{phase.unit} is updated twice")
                    updated.add(phase.unit)
        if not norm_done:
            raise PluginError("the step program never finishes the global gradient norm")
        self._validate_ties()
        missing = sorted(set(self.units()) - updated)
        if missing:
            raise PluginError(f"the step program never updates {', '.join(missing)}")

    def _validate_ties(self) -> None:
        """A tied variable's owner is a unit of the model and computes its gradient after every use's."""
        units, phases = set(self.units()), self.phases
        for tie in self.ties:
            where = f"{tie.role} variable {tie.name} is tied to {tie.owner}.{tie.variable}"
            if tie.owner not in units or tie.owner.role == tie.role:
                raise PluginError(f"{where}: not a variable of another unit of this model")
            if not tie.trainable:
                continue
            owner = [i for i, p in enumerate(phases) if p.unit == tie.owner and p.computes_gradient]
            users = [i for i, p in enumerate(phases) if p.role == tie.role and p.computes_gradient]
            if len(owner) != 1 or (users and max(users) > owner[0]):
                raise PluginError(f"invalid step program: {where}, so {tie.owner} must compute its gradient "
                                  f"once, after every {tie.role} gradient")


def _need(condition: bool, phase: Phase, why: str) -> None:
    if not condition:
        raise PluginError(f"invalid step program at phase {phase.name}: {why}")


def emit_standard_phases(program: StepProgram, role: str) -> None:
    """The reference's phases of a component of ``role``: what every stock component runs, and what core
    emits for any component whose plugin does not answer ``ipuft_emit_phases``.

    - embeddings: forward; then backward, the global norm and the update in one phase (the embedding
      gradient is used at once, never stored, and this phase finishes the norm every update needs);
    - decoder: each layer's forward in order, backward in reverse order, update in order;
    - head: loss and backward; update.
    """
    if role == "embeddings":
        program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,)))
        program.emit(Stage.EMBEDDINGS_BACKWARD_OPTIMIZER,
                     Phase("embeddings", None, (Op.BACKWARD, Op.GLOBAL_NORM, Op.OPTIMIZER_STEP)))
    elif role == "decoder":
        layers = range(program.layers)
        for n in layers:
            program.emit(Stage.DECODER_FORWARD, Phase("decoder", n, (Op.FORWARD,)))
        for n in reversed(layers):
            program.emit(Stage.DECODER_BACKWARD, Phase("decoder", n, (Op.BACKWARD,)))
        for n in layers:
            program.emit(Stage.DECODER_OPTIMIZER, Phase("decoder", n, (Op.OPTIMIZER_STEP,)))
    elif role == "head":
        program.emit(Stage.HEAD_FORWARD_BACKWARD, Phase("head", None, (Op.LOSS_BACKWARD,)))
        program.emit(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,)))
    else:
        raise PluginError(f"no standard phases for role {role!r}")
