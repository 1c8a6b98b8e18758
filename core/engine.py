"""The phased execution engine: runs the step program, phase by phase, over every micro-batch.

Each phase brings one unit's variables to the compute device, loops over all gradient-accumulation
micro-batches (layer-major batch serialisation), and stores back what it changed. The decoder's backward
recomputes each layer's forward from its buffered input ``x[n][mb]``. The global gradient norm gathers
every unit's gradient before any optimizer step runs, as in the reference's ``finetuning()``.

Gradients are accumulated carrying the loss scale ``S`` and averaged over micro-batches: each
micro-batch's backward is seeded with ``S / GA``.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from torch.func import functional_call

from ipuft.activations import ActivationBuffers, working_set
from ipuft.components import Init, VariableSpec, recompute
from ipuft.model import ModelParts
from ipuft.optim import Optimizer, StepContext
from ipuft.program import Op, Phase
from ipuft.store import Tensors, VariableStore, nbytes


@dataclass
class Batch:
    """One optimizer step's data for this replica: ``[GA, micro_batch_size, sequence_length]`` each."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def micro_batches(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    h2d_bytes: int
    d2h_bytes: int
    device_peak_bytes: int
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class _StepState:
    batch: Batch
    lr: float
    norm_sq: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norm: float = float("nan")


def optimizer_state_specs(parts: ModelParts, optimizer: Optimizer, role: str):
    """The ``optim`` group's variable specs of a unit of ``role``, named ``<variable>.<state>``."""
    return [
        VariableSpec(f"{v.name}.{s.name}", s.shape, s.dtype, s.init)
        for v in parts.variables[role]
        for s in optimizer.state_specs(v)
    ]


def unit_role(unit: str) -> str:
    return unit.split(".", 1)[0]


class PhasedEngine:
    """Owns the variable store and runs optimizer steps through the step program."""

    def __init__(self, cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, device: torch.device) -> None:
        self.cfg = cfg
        self.parts = parts
        self.program = parts.program
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.layers = cfg.model.layers
        self.loss_scaling = float(cfg.execution.loss_scaling)
        self.dropout = cfg.model.dropout_prob > 0
        self.store = VariableStore(self.device, offload=cfg.execution.offload)
        self.buffers = ActivationBuffers(self.store, offload=cfg.execution.activation_offload)
        self.updates = 0  # optimizer steps taken; Adam's bias correction counts from 1
        self.modules = parts.modules
        for module in self.modules.values():
            module.train(True)
        self._allocate(cfg.model.seed)

    # ---- setup ----

    def _allocate(self, seed: int) -> None:
        stores_grad = {p.unit for p in self.program if p.computes_gradient and "grad" in p.stores}
        for unit in self.program.units():
            role = unit_role(unit)
            self.store.allocate(unit, "fwd", self.parts.variables[role], seed=seed)
            self.store.allocate(unit, "optim", optimizer_state_specs(self.parts, self.optimizer, role))
            if unit in stores_grad:
                zeros = [VariableSpec(v.name, v.shape, v.dtype, Init("zeros")) for v in self.parts.variables[role]]
                self.store.allocate(unit, "grad", zeros)

    # ---- one step ----

    def step(self, batch: Batch, lr: float) -> StepResult:
        """Run one optimizer step over ``batch`` with learning rate ``lr``."""
        if batch.micro_batches != self.cfg.gradient_accumulation:
            raise ValueError(f"batch has {batch.micro_batches} micro-batches, expected {self.cfg.gradient_accumulation}")
        before_h2d, before_d2h = dict(self.store.traffic.h2d), dict(self.store.traffic.d2h)
        self.store.ledger.reset_peak()
        self.updates += 1
        batch = Batch(batch.input_ids.to(self.device), batch.labels.to(self.device))
        self.store.traffic.h2d["data"] += 2 * batch.tokens * batch.input_ids.element_size()
        state = _StepState(batch, lr, torch.zeros((), dtype=torch.float32, device=self.device))
        phases = self.program.phases
        for i, phase in enumerate(phases):
            self._prefetch(phase, phases[i + 1] if i + 1 < len(phases) else None)
            self._run(phase, state)
        self.buffers.clear()
        loss = torch.stack(state.losses).mean().item()
        traffic = {
            "h2d": {k: v - before_h2d.get(k, 0) for k, v in self.store.traffic.h2d.items()},
            "d2h": {k: v - before_d2h.get(k, 0) for k, v in self.store.traffic.d2h.items()},
        }
        return StepResult(
            loss=loss,
            grad_norm=state.grad_norm,
            h2d_bytes=sum(traffic["h2d"].values()),
            d2h_bytes=sum(traffic["d2h"].values()),
            device_peak_bytes=self.store.ledger.peak,
            traffic=traffic,
        )

    def _prefetch(self, current: Phase, following: Phase | None) -> None:
        """On CUDA, start copying the next phase's variables while this phase computes."""
        if following is None or following.unit == current.unit:
            return
        for group in following.loads:
            self.store.prefetch(following.unit, group)

    def _run(self, phase: Phase, st: _StepState) -> None:
        unit, module = phase.unit, self.modules[phase.role]
        loaded = {group: self.store.load(unit, group) for group in phase.loads}
        grads = loaded.get("grad")
        for op in phase.ops:
            if op is Op.FORWARD:
                self._forward(phase, module, loaded["fwd"], st)
            elif op in (Op.LOSS_BACKWARD, Op.BACKWARD):
                self.store.ledger.acquire(nbytes(loaded["fwd"].values()))  # the gradients autograd will fill
                grads = self._backward(phase, module, loaded["fwd"], st)
                self._add_to_norm(grads, st)
            elif op is Op.GLOBAL_NORM:
                st.grad_norm = st.norm_sq.sqrt().item()
            elif op is Op.OPTIMIZER_STEP:
                self._optimizer_step(phase, loaded["fwd"], loaded["optim"], grads, st)
        for group in phase.stores:
            self.store.save(unit, group, grads if group == "grad" else loaded[group])
        for group, tensors in loaded.items():
            self.store.release(unit, group, tensors)
        if phase.computes_gradient and "grad" not in loaded:
            self.store.ledger.release(nbytes(grads.values()))

    # ---- ops ----

    def _rng(self, unit: str, mb: int):
        """The same dropout masks in a layer's forward and in its recompute."""
        if not self.dropout:
            return contextlib.nullcontext()
        seed = hash((self.cfg.model.seed, self.updates, zlib.crc32(unit.encode()), mb)) & 0x7FFF_FFFF
        devices = [self.device] if self.device.type == "cuda" else []
        ctx = torch.random.fork_rng(devices=devices)

        @contextlib.contextmanager
        def seeded():
            with ctx:
                torch.manual_seed(seed)
                yield

        return seeded()

    def _forward(self, phase: Phase, module: torch.nn.Module, weights: Tensors, st: _StepState) -> None:
        x_in, x_out = self.program.activation_rows(phase)
        with torch.no_grad():
            for mb in range(st.batch.micro_batches):
                if x_in is None:
                    with self._rng(phase.unit, mb):
                        out = functional_call(module, weights, (st.batch.input_ids[mb],))
                else:
                    with self.buffers.read("x", x_in, mb) as x, self._rng(phase.unit, mb):
                        out = functional_call(module, weights, (x,))
                self.buffers.write("x", x_out, mb, out)

    def _backward(self, phase: Phase, module, weights: Tensors, st: _StepState) -> Tensors:
        """Loss-backward (head) or recompute-backward (decoder, embeddings) of every micro-batch; returns
        the unit's gradients, summed over micro-batches by autograd itself (into the leaves' ``.grad``)."""
        x_in, x_out = self.program.activation_rows(phase)
        seed_scale = self.loss_scaling / st.batch.micro_batches
        params = {n: t.detach().requires_grad_() for n, t in weights.items()}
        for mb in range(st.batch.micro_batches):
            with contextlib.ExitStack() as stack:
                if x_in is None:
                    inputs, args = [], (st.batch.input_ids[mb],)
                else:
                    x = stack.enter_context(self.buffers.read("x", x_in, mb, consume=True)).detach().requires_grad_()
                    inputs, args = [x], (x,)
                if x_out is None:  # the head: loss, and the gradient that seeds the backward
                    args = (*args, st.batch.labels[mb])
                    seed = None
                else:
                    seed = stack.enter_context(self.buffers.read("dx", x_out, mb, consume=True))
                    stack.enter_context(recompute())  # only the gradient of this forward is used
                stack.enter_context(working_set(self.store, list(params.values()) + inputs))
                with self._rng(phase.unit, mb):
                    out = functional_call(module, params, args)
                if seed is None:
                    st.losses.append(out.detach())
                    out = out * seed_scale
                torch.autograd.backward(out, seed, inputs=inputs + list(params.values()))
            if inputs:
                self.buffers.write("dx", x_in, mb, inputs[0].grad)
        return {n: p.grad for n, p in params.items()}

    def _add_to_norm(self, grads: Tensors, st: _StepState) -> None:
        """Add the squared norm of the unscaled gradient to the step's global norm."""
        with torch.no_grad():
            for g in grads.values():
                st.norm_sq += g.float().div(self.loss_scaling).square().sum()

    def _optimizer_step(self, phase: Phase, weights: Tensors, optim: Tensors, grads: Tensors, st: _StepState):
        ctx = StepContext(lr=st.lr, global_norm=st.grad_norm, loss_scaling=self.loss_scaling,
                          step=self.updates)
        for name, w in weights.items():
            state = {key.rsplit(".", 1)[1]: t for key, t in optim.items() if key.rsplit(".", 1)[0] == name}
            self.optimizer.step(f"{phase.unit}.{name}", w, grads[name], state, ctx)

    # ---- whole-model views ----

    def weights(self) -> dict[str, Tensors]:
        """Every unit's weights as stored, keyed by unit (host tensors when offloaded)."""
        return self.store.state("fwd")

