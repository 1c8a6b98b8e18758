"""What a step holds, in bytes: each variable group one rank stores, and what each phase holds on the compute
device at its busiest (:class:`PhaseMemory`), computed from the real variable shapes and the units' measured
costs (:mod:`ipuft.plan.measure`) without allocating anything. ``ipuft plan`` (:mod:`ipuft.plan.estimate`)
reports them; the engine's ledger is bounded by them, phase by phase.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ipuft.components import VariableSpec
from ipuft.engine.cuts import (
    call_chunk,
    double_buffered,
    gradient_working_bytes,
    group_transient_bytes,
    one_pass,
    piece_elements,
    piece_multiple,
    step_shape,
    take_every,
    update_groups,
    writes_into_stored,
)
from ipuft.engine.model import ModelParts
from ipuft.engine.variables import model_groups, placements
from ipuft.kernels import compute_device
from ipuft.optim import Optimizer
from ipuft.parallel import Layout
from ipuft.plan.measure import UnitCost
from ipuft.precision import Recipe, compute_dtype, recipe
from ipuft.program import GROUPS, Move, Op, Phase, PhaseMoves


def specs_bytes(specs: list[VariableSpec]) -> int:
    return sum(s.nbytes for s in specs)


def stored_bytes(sizes: dict[str, int]) -> int:
    """The bytes of a unit's stored groups (``trainable`` is a part of ``fwd``, not a group)."""
    return sizes["fwd"] + sizes["optim"] + sizes["grad"]


def frozen_savings(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, sizes: dict[str, dict[str, int]]) -> int:
    """The bytes one rank does not store because variables are frozen: their gradients and optimizer state."""
    if all(v.trainable for specs in parts.variables.values() for v in specs):
        return 0
    unfrozen = dataclasses.replace(parts, variables={role: [dataclasses.replace(v, trainable=True) for v in specs]
                                                     for role, specs in parts.variables.items()})
    everything = group_bytes(cfg, unfrozen, optimizer)
    return sum(stored_bytes(s) for s in everything.values()) - sum(stored_bytes(s) for s in sizes.values())


def rank_layout(cfg: DictConfig) -> Layout:
    """The layout of rank 0 of the configured DP × TP grid (sizes only; no process groups)."""
    return Layout(cfg.execution.data_parallel, cfg.execution.tensor_parallel)


def group_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer) -> dict[str, dict[str, int]]:
    """Bytes one rank stores of each variable group of each unit, as the engine allocates them
    (:func:`~ipuft.engine.variables.model_groups`: its TP shard, and with RTS its 1/DP slice of that; ``grad``
    only where the program stores gradients, 0 elsewhere). ``trainable`` is the part of ``fwd`` that is trained
    (what an update-only phase moves)."""
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts), optimizer)
    stored_groups = model_groups(parts.program, placed, optimizer, recipe(cfg) is Recipe.master,
                                 step_shape(cfg).host_update)
    out = {}
    for unit, groups in stored_groups.items():
        sizes = dict.fromkeys(GROUPS, 0) | {group: specs_bytes(specs) for group, specs in groups.items()}
        sizes["trainable"] = specs_bytes([s for s in groups["fwd"] if s.trainable])
        # Tied variables: the owners' weights a unit of this role computes with, and the float32 gradients
        # of the trained ones, which it writes into their owners' stored gradients (and an owner adds).
        used = parts.program.used_ties(unit.role)
        sizes["borrowed"] = specs_bytes([placed[t.owner.role][t.variable].stored_spec() for t in used])
        sizes["lent"] = sum(placed[t.owner.role][t.variable].stored_spec().numel * 4 for t in used if t.trainable)
        sizes["carried"] = sum(placed[unit.role][t.variable].stored_spec().numel * 4
                               for t in parts.program.owned_ties(unit))
        out[unit] = sizes
    return out


def activation_peak_bytes(cfg: DictConfig) -> int:
    """The peak bytes one rank's x/dx buffers hold: the ``(L+1)·GA`` entries of ``x`` live at the end of
    the forward; ``dx`` holds only rows in flight, never more than the ``x`` entries already consumed.

    With ``activation_offload=disk`` (:mod:`ipuft.engine.spill`) memory holds at most ``2·GA + 1`` entries:
    in the forward, the row being read and the row being written (one row between them) and the writer's
    queue (a row, and the entry it writes); in the backward, the reader's row ahead and ``dx``'s row in flight
    with the gradient being made."""
    shape = step_shape(cfg)
    everything = (shape.layers + 1) * shape.micro_batches * shape.stored_activation_bytes
    if shape.spills:
        return min(everything, (2 * shape.micro_batches + 1) * shape.stored_activation_bytes)
    return everything


def graph_bytes(cfg: DictConfig, parts: ModelParts, costs: dict[str, UnitCost]) -> int:
    """``execution.recompute=false``: the bytes of the forward graphs kept at the end of the forward, every
    decoder layer's and the embeddings' for every micro-batch (what autograd saves, measured per unit)."""
    if cfg.execution.recompute:
        return 0
    embeddings = costs["embeddings"].saved_bytes if any(v.trainable for v in parts.variables["embeddings"]) else 0
    return cfg.gradient_accumulation * (cfg.model.layers * costs["decoder"].saved_bytes + embeddings)


def phase_moves(cfg: DictConfig, parts: ModelParts, phase: Phase) -> PhaseMoves | None:
    """What ``phase`` moves under ``cfg`` (:meth:`~ipuft.program.StepProgram.moves`, as the engine asks it)."""
    trainable = any(v.trainable for v in parts.variables[phase.role])
    return parts.program.moves(phase, trainable, step_shape(cfg).host_update)


def phase_io(moves: PhaseMoves, unit: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The bytes a phase loads and stores of each group of its unit (``unit``: :func:`group_bytes`'s), as the
    engine moves them when offloaded."""
    def size(move: Move) -> int:
        return unit["trainable"] if move.trainable_only else unit[move.group]

    loads, stores = {m.group: size(m) for m in moves.loads}, {m.group: size(m) for m in moves.stores}
    for moved, group, key, tied in ((loads, "fwd", "borrowed", moves.borrows), (stores, "grad", "lent", moves.lends),
                                    (loads, "grad", "carried", moves.carries)):
        if tied:
            moved[group] = moved.get(group, 0) + unit[key]
    return loads, stores


def update_transient_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, role: str) -> int:
    """The most bytes one optimizer call on a unit of ``role`` adds on the device (the float32 views and
    gradients of 16-bit weights, the stochastic rounding's workspace): the engine's largest group of pieces
    (:func:`ipuft.engine.cuts.update_groups`) of the unit's stored trainable variables."""
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts), optimizer)[role]
    sizes = [(name, math.prod(p.stored_shape)) for name, p in placed.items() if p.spec.trainable]
    how = recipe(cfg)
    single = one_pass(optimizer, how, compute_device(cfg))
    return max((group_transient_bytes(how, [stop - start for _, start, stop in group], single)
                for group in update_groups(sizes, call_chunk(optimizer, compute_device(cfg)),
                                           piece_multiple(optimizer))), default=0)


def streamed_update_bytes(cfg: DictConfig, optimizer: Optimizer, groups: dict[str, list[VariableSpec]],
                          streamed: frozenset[str]) -> int:
    """The most bytes a streamed update (:mod:`ipuft.engine.streaming`) of a unit stored as ``groups`` holds on
    the device: one call's pieces of the ``streamed`` groups with that call's transients, and on CUDA the next
    call's pieces beside them (their copy overlaps the update)."""
    trainable = [s for s in groups["fwd"] if s.trainable]
    numel = {s.name: s.numel for s in trainable}
    per = dict.fromkeys(numel, 0)  # bytes per element of each variable in the streamed groups
    per_block = dict.fromkeys(numel, 0)  # and per block, of its block-wise state (an 8-bit optimizer's scales)
    block = piece_multiple(optimizer)
    for group in streamed:
        for s in groups.get(group, ()):
            name = s.name.variable if group == "optim" else s.name
            if name in per:
                blocked = group == "optim" and s.name.state in optimizer.block_states
                (per_block if blocked else per)[name] += s.dtype.itemsize

    def piece(n: str, a: int, b: int) -> int:  # a piece starts on a block boundary: its blocks are whole
        return (b - a) * per[n] + -(-(b - a) // block) * per_block[n]

    total = sum(piece(n, 0, numel[n]) for n in numel)
    device = compute_device(cfg)
    chunk = call_chunk(optimizer, device, piece_elements(cfg.execution.update_piece_bytes, sum(numel.values()), total))
    how = recipe(cfg)
    single = one_pass(optimizer, how, device)
    calls = [(sum(piece(n, a, b) for n, a, b in g), group_transient_bytes(how, [b - a for _, a, b in g], single))
             for g in update_groups(list(numel.items()), chunk, block)]
    ahead = double_buffered(device)
    return max((piece + transient + (calls[k + 1][0] if ahead and k + 1 < len(calls) else 0)
                for k, (piece, transient) in enumerate(calls)), default=0)


def sliced_gradient_bytes(cfg: DictConfig, parts: ModelParts, role: str, unit: dict[str, int], cost: UnitCost) -> int:
    """The stored bytes of the gradient a unit of ``role`` makes by vocabulary slices straight into the stored
    gradients (``execution.head_vocab_slices``, :mod:`ipuft.engine.sliced`: none of it whole on the device): a
    tied table's float32 gradient, which the head lends (``unit``: :func:`group_bytes`'s), or the head's own."""
    if not cost.sliced_gradient_numel:
        return 0
    if unit["lent"]:
        return unit["lent"]
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts))[role]
    return next((p.stored_spec().nbytes for p in placed.values()
                 if p.spec.trainable and p.local_numel == cost.sliced_gradient_numel), 0)


@dataclass(frozen=True)
class PhaseMemory:
    """What one phase holds on the compute device at its busiest, in bytes, beside the variables that stay
    there (offload off) and the step's buffered activations and kept graphs:

    - ``loaded``: the groups it loads (offloaded; nothing where the store lends them, on a CPU device);
    - ``compute``: its busiest micro-batch: a forward, or a recompute and backward with its fresh gradients,
      the unit's gradient summed so far and what the projections hold for the weight gradients taken later;
    - ``update``: an update on the device: the finished gradients and one optimizer call's transients.
    """

    loaded: int = 0
    compute: int = 0
    update: int = 0


def phase_memory(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, sizes: dict[str, dict[str, int]],
                 costs: dict[str, UnitCost], lent: bool = False) -> dict[str, PhaseMemory]:
    """Every phase's :class:`PhaseMemory`, by phase name (phases that move nothing hold nothing). ``lent``:
    count the variables a phase loads as nothing, as on a CPU device."""
    shape = step_shape(cfg)
    host_update = shape.host_update
    wide = compute_dtype(cfg) != torch.float32
    transient = {role: update_transient_bytes(cfg, parts, optimizer, role) for role in parts.variables}
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts))
    stored_groups = model_groups(parts.program, placed, optimizer, recipe(cfg) is Recipe.master, host_update)
    ga, dp = cfg.gradient_accumulation, cfg.execution.data_parallel
    every = take_every(ga, cfg.execution.micro_batch_size * cfg.model.sequence_length)
    takes = -(-ga // every)
    # The stored gradients live in the compute device's memory (offload off, or a CPU device): a take may
    # write into them.
    in_compute_memory = not cfg.execution.offload or compute_device(cfg).type == "cpu"
    stores_grad = parts.program.grad_units(host_update)
    out = {}
    for phase in parts.program:
        unit, cost = sizes[phase.unit], costs[phase.role]
        moves = phase_moves(cfg, parts, phase)
        if moves is None:
            out[phase.name] = PhaseMemory()
            continue
        streamed = shape.streamed_groups(phase, moves)
        table = bool(moves.carries) and "grad" in streamed  # tied tables' gradients stay in host memory
        loads = phase_io(moves, unit)[0]
        loaded = sum(v for g, v in loads.items() if g not in streamed) if cfg.execution.offload and not lent else 0
        grads = unit["trainable"] + unit["lent"] - sliced_gradient_bytes(cfg, parts, phase.role, unit, cost) \
            if phase.computes_gradient and not table else 0
        micro_batch = [cost.forward_peak_bytes] if Op.FORWARD in phase.ops else []
        fresh = grads  # the finished gradients beyond the stored ones
        if phase.computes_gradient:
            # What a micro-batch makes and holds, measured with its taken gradients written into given memory
            # (at least autograd's gradients with what autograd saved, or with the projections' held pieces);
            # beside it, the unit's gradients summed so far and, where the takes cannot write into the stored
            # gradients, their fresh ones; the earlier micro-batches' pieces of a take come on top, and when a
            # take covers several, its inputs concatenated.
            # The gradients ops sum as they go (a chunked head's weight) are neither autograd's nor taken: their
            # float32 sums are in the measured peaks; rounded in place, unless a float32 mean over DP follows.
            summed = min(cost.accumulated_gradient_bytes, grads)
            taken = min(cost.taken_bytes, grads - summed)
            autograd = grads - taken - summed
            into_stored = writes_into_stored(wide, takes, dp, in_compute_memory and phase.unit in stores_grad)
            working = gradient_working_bytes(autograd, taken, wide, ga, takes, dp, into_stored)
            fresh_taken = 0 if into_stored else taken  # the takes' gradients, made afresh
            made = autograd + fresh_taken
            fresh = made + cost.accumulated_bytes + (summed if wide and dp > 1 else 0)
            held = (2 * every - 1) * cost.held_bytes if every > 1 else 0
            busiest = max(cost.backward_peak_bytes, cost.take_peak_bytes + fresh_taken)
            micro_batch.append(working - made + held + max(busiest, made + cost.saved_bytes, made + cost.held_bytes)
                               + (summed if wide and dp > 1 else 0))
        # The tied variables' float32 sum beside its rounding (ipuft.engine.compute); in float32, their gradient,
        # which a take never writes into the stored one (that holds the other uses' parts, carried in).
        if moves.carries and (wide or into_stored) and not table:
            fresh += unit["carried"]
            if host_update and phase.computes_gradient:  # no update on the device to hold it: it is made here
                micro_batch[-1] += unit["carried"]
        compute = max(micro_batch) if phase.computes else 0
        # The update holds only the finished (16-bit) gradients; one in host memory holds nothing on the device.
        update = 0
        if phase.updates and not host_update:
            update = fresh + (streamed_update_bytes(cfg, optimizer, stored_groups[phase.unit], streamed) if streamed
                              else transient[phase.role])
        out[phase.name] = PhaseMemory(loaded, compute, update)
    return out


def resident_activation_bytes(cfg: DictConfig) -> int:
    """The most bytes of buffered activations on the device while a phase computes: with activation offload one
    row in, one out and a gradient in flight (and their TP slices); else every buffered entry, and under TP the
    entries gathered from their slices."""
    shape = step_shape(cfg)
    act, tp = shape.activation_bytes, shape.tensor_parallel
    if cfg.execution.activation_offload:
        return 3 * act + (3 * shape.stored_activation_bytes if tp > 1 else 0)
    return activation_peak_bytes(cfg) + (3 * act if tp > 1 else 0)


def device_peak_estimate(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, sizes: dict[str, dict[str, int]],
                         costs: dict[str, UnitCost], lent: bool = False) -> int:
    """The largest phase's resident bytes: the variables that stay on the device, the kept graphs
    (recompute=false: all there when the head's loss-backward runs, an upper bound for every phase), and the
    phase's :class:`PhaseMemory`, with the buffered activations beside its compute."""
    resident_vars = 0 if cfg.execution.offload else sum(stored_bytes(s) for s in sizes.values())
    graphs = graph_bytes(cfg, parts, costs)
    acts = resident_activation_bytes(cfg)
    holds = phase_memory(cfg, parts, optimizer, sizes, costs, lent)
    peak = 0
    for phase in parts.program:
        held = holds[phase.name]
        compute = acts + held.compute if phase.computes else 0
        peak = max(peak, resident_vars + graphs + held.loaded + max(compute, held.update))
    return peak


def init_host_bytes(cfg: DictConfig, parts: ModelParts) -> int:
    """What filling the store adds to host memory at its busiest: the engine initialises one unit at a time
    from its full float32 weights (random draws, or a checkpoint's), which stay beside the store until they
    are cut to this rank's shards or rounded to 16 bits (for unsharded float32 weights they become the store)."""
    sharded = cfg.execution.tensor_parallel > 1 or bool(cfg.execution.rts)
    if compute_dtype(cfg) == torch.float32 and not sharded:
        return 0
    return max(sum(v.numel * 4 for v in parts.variables[role]) for role in parts.variables)


# What a process computing on the CPU keeps besides the tensors the plan counts and what it held at start: the
# math libraries' buffers, the engine's own objects, and the blocks glibc's heap keeps once the busiest
# micro-batch has freed them (execution.retain_host_memory; ipuft.hostmem). tests/test_width.py holds
# peak RSS between 90% and 100% of the plan with this allowance at GPT-J-6B's width. The heap's share that
# grows with the model, one micro-batch's blocks under its limit, is added from its measurement
# (UnitCost.heap_peak_bytes).
CPU_RUNTIME_BYTES = 512 * 2**20


