"""``ipuft plan``: the step program with what each phase moves, and a memory and traffic estimate, all
computed from the real variable shapes without allocating anything (components are on the meta device).

Traffic per optimizer step is exact: the engine's counters must equal it. The device peak is an estimate:
it adds the largest phase's variables, gradients, resident activations, and the busiest moment of one
micro-batch through its unit (measured by running the unit on the meta device, :mod:`ipuft.engine.measure`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict

import torch
from omegaconf import DictConfig

from ipuft.components import VariableSpec
from ipuft.engine.flops import step_flops
from ipuft.engine.measure import UnitCost, kv_cache_bytes_per_position, unit_cost
from ipuft.engine.model import ModelParts
from ipuft.engine.phased import updates_on_host
from ipuft.engine.precision import Recipe, compute_dtype, gradient_working_bytes, recipe, take_every
from ipuft.engine.update import group_transient_bytes, update_chunk, update_groups
from ipuft.engine.variables import placements, unit_groups
from ipuft.optim import Optimizer
from ipuft.parallel import Layout
from ipuft.plugins import PluginHooks
from ipuft.program import GROUPS, Move, Op, Phase, PhaseMoves

TOKEN_BYTES = torch.empty((), dtype=torch.int64).element_size()


def _bytes(specs: list[VariableSpec]) -> int:
    return sum(s.nbytes for s in specs)


def _stored(sizes: dict[str, int]) -> int:
    """The bytes of a unit's stored groups (``trainable`` is a part of ``fwd``, not a group)."""
    return sizes["fwd"] + sizes["optim"] + sizes["grad"]


def frozen_savings(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, sizes: dict[str, dict[str, int]]) -> int:
    """The bytes one rank does not store because variables are frozen: their gradients and optimizer state."""
    if all(v.trainable for specs in parts.variables.values() for v in specs):
        return 0
    unfrozen = dataclasses.replace(parts, variables={role: [dataclasses.replace(v, trainable=True) for v in specs]
                                                     for role, specs in parts.variables.items()})
    everything = group_bytes(cfg, unfrozen, optimizer)
    return sum(_stored(s) for s in everything.values()) - sum(_stored(s) for s in sizes.values())


def rank_layout(cfg: DictConfig) -> Layout:
    """The layout of rank 0 of the configured DP × TP grid (sizes only; no process groups)."""
    return Layout(cfg.execution.data_parallel, cfg.execution.tensor_parallel)


def group_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer) -> dict[str, dict[str, int]]:
    """Bytes one rank stores of each variable group of each unit, as the engine allocates them
    (:func:`~ipuft.engine.variables.unit_groups`: its TP shard, and with RTS its 1/DP slice of that; ``grad``
    only where the program stores gradients, 0 elsewhere). ``trainable`` is the part of ``fwd`` that is trained
    (what an update-only phase moves)."""
    stores_grad = parts.program.grad_units(updates_on_host(cfg))
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts))
    master = recipe(cfg) is Recipe.master
    out = {}
    for unit in parts.program.units():
        groups = unit_groups(placed[unit.role], optimizer, master, unit in stores_grad)
        sizes = dict.fromkeys(GROUPS, 0) | {group: _bytes(specs) for group, specs in groups.items()}
        sizes["trainable"] = _bytes([s for s in groups["fwd"] if s.trainable])
        out[unit] = sizes
    return out


def activation_bytes(cfg: DictConfig) -> int:
    """One micro-batch's layer-boundary activation ``x[n][mb]``, in the compute dtype."""
    itemsize = torch.empty((), dtype=compute_dtype(cfg)).element_size()
    return cfg.execution.micro_batch_size * cfg.model.sequence_length * cfg.model.hidden_size * itemsize


def stored_activation_bytes(cfg: DictConfig) -> int:
    """What one TP rank stores of one buffered activation: its 1/TP slice."""
    return activation_bytes(cfg) // cfg.execution.tensor_parallel


def activation_peak_bytes(cfg: DictConfig) -> int:
    """The peak bytes one rank's x/dx buffers hold: the ``(L+1)·GA`` entries of ``x`` live at the end of
    the forward; ``dx`` holds only rows in flight, never more than the ``x`` entries already consumed."""
    return (cfg.model.layers + 1) * cfg.gradient_accumulation * stored_activation_bytes(cfg)


def graph_bytes(cfg: DictConfig, parts: ModelParts, costs: dict[str, UnitCost]) -> int:
    """``execution.recompute=false``: the bytes of the forward graphs kept at the end of the forward, every
    decoder layer's and the embeddings' for every micro-batch (what autograd saves, measured per unit)."""
    if cfg.execution.recompute:
        return 0
    embeddings = costs["embeddings"].saved_bytes if any(v.trainable for v in parts.variables["embeddings"]) else 0
    return cfg.gradient_accumulation * (cfg.model.layers * costs["decoder"].saved_bytes + embeddings)


def traffic(cfg: DictConfig, parts: ModelParts, sizes: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Host↔device bytes of one optimizer step, per category: what :meth:`~ipuft.program.StepProgram.moves`
    says each phase moves, summed as the engine's counters count it."""
    h2d: dict[str, int] = defaultdict(int)
    d2h: dict[str, int] = defaultdict(int)
    ga = cfg.gradient_accumulation
    h2d["data"] = 2 * ga * cfg.execution.micro_batch_size * cfg.model.sequence_length * TOKEN_BYTES
    act = stored_activation_bytes(cfg)
    for phase in parts.program:
        moves = phase_moves(cfg, parts, phase)
        if moves is None:
            continue
        if cfg.execution.offload:
            loads, stores = phase_io(moves, sizes[phase.unit])
            for group, n in loads.items():
                h2d[group] += n
            for group, n in stores.items():
                d2h[group] += n
        if cfg.execution.activation_offload:
            h2d["activation"] += moves.activation_reads * ga * act
            d2h["activation"] += moves.activation_writes * ga * act
    return {"h2d": dict(h2d), "d2h": dict(d2h)}


def phase_moves(cfg: DictConfig, parts: ModelParts, phase: Phase) -> PhaseMoves | None:
    """What ``phase`` moves under ``cfg`` (:meth:`~ipuft.program.StepProgram.moves`, as the engine asks it)."""
    trainable = any(v.trainable for v in parts.variables[phase.role])
    return parts.program.moves(phase, trainable, updates_on_host(cfg))


def phase_io(moves: PhaseMoves, unit: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The bytes a phase loads and stores of each group of its unit (``unit``: :func:`group_bytes`'s), as the
    engine moves them when offloaded."""
    def size(move: Move) -> int:
        return unit["trainable"] if move.trainable_only else unit[move.group]

    return {m.group: size(m) for m in moves.loads}, {m.group: size(m) for m in moves.stores}


def compute_device(cfg: DictConfig) -> torch.device:
    """The device the run computes on (``execution.device``; ``auto``: CUDA when there is one), as the plan
    sees it (device 0)."""
    cuda = cfg.execution.device.value != "cpu" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def update_transient_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, role: str) -> int:
    """The most bytes one optimizer call on a unit of ``role`` adds on the device (the float32 views and
    gradients of 16-bit weights, the stochastic rounding's workspace): the engine's largest group of pieces
    (:func:`ipuft.engine.phased.update_groups`) of the unit's stored trainable variables."""
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts))[role]
    sizes = [(name, math.prod(p.stored_shape)) for name, p in placed.items() if p.spec.trainable]
    chunk = update_chunk(compute_device(cfg)) if getattr(optimizer, "elementwise", True) else None
    how = recipe(cfg)
    return max((group_transient_bytes(how, [stop - start for _, start, stop in group])
                for group in update_groups(sizes, chunk)), default=0)


def device_peak_estimate(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer, sizes: dict[str, dict[str, int]],
                         costs: dict[str, UnitCost], lent: bool = False) -> int:
    """The largest phase's resident bytes: see the module docstring. ``lent``: count the variables a phase
    loads as nothing, as on a CPU device, where the store lends them (the bytes the phases add to the store's)."""
    act = activation_bytes(cfg)
    resident_vars = 0 if cfg.execution.offload else sum(_stored(s) for s in sizes.values())
    # Offloaded: one row in, one out and a gradient in flight (and their TP slices); else every buffered
    # entry, and under TP the entries gathered from their slices.
    tp = cfg.execution.tensor_parallel
    if cfg.execution.activation_offload:
        acts = 3 * act + (3 * stored_activation_bytes(cfg) if tp > 1 else 0)
    else:
        acts = activation_peak_bytes(cfg) + (3 * act if tp > 1 else 0)
    # recompute=false: the kept graphs peak at the end of the forward, and are all there when the head's
    # loss-backward runs; an upper bound for every phase.
    graphs = graph_bytes(cfg, parts, costs)
    host_update = updates_on_host(cfg)
    wide = compute_dtype(cfg) != torch.float32
    transient = {role: update_transient_bytes(cfg, parts, optimizer, role) for role in parts.variables}
    peak = 0
    for phase in parts.program:
        unit, cost = sizes[phase.unit], costs[phase.role]
        moves = phase_moves(cfg, parts, phase)
        if moves is None:
            continue
        io = phase_io(moves, unit)
        loaded = sum(io[0].values()) if cfg.execution.offload and not lent else 0
        # A micro-batch's busiest moment (its fresh gradients included; at least what the engine's ledger counts
        # for it: its gradients and what autograd saved), and beside it the unit's gradient summed so far (the
        # float32 sums of 16-bit weights).
        # What the projections hold for the weight gradients taken later (ipuft.ops) comes on top: the earlier
        # micro-batches' of a take, and when a take covers several, its inputs concatenated.
        grads = unit["trainable"] if phase.computes_gradient else 0
        micro_batch = [cost.forward_peak_bytes] if Op.FORWARD in phase.ops else []
        if phase.computes_gradient:
            summed = gradient_working_bytes(grads, wide, cfg.gradient_accumulation, cfg.execution.data_parallel) - grads
            every = take_every(cfg.gradient_accumulation, cfg.execution.micro_batch_size * cfg.model.sequence_length)
            held = (2 * every - 1) * cost.held_bytes if every > 1 else 0
            micro_batch.append(summed + held + max(cost.backward_peak_bytes, grads + cost.saved_bytes,
                                                   grads + cost.held_bytes))
        compute = acts + max(micro_batch) if phase.computes else 0
        # The update holds only the finished (16-bit) gradients. An update in host memory holds nothing on the
        # device.
        device_update = phase.updates and not host_update
        update = grads + transient[phase.role] if device_update else 0
        peak = max(peak, resident_vars + graphs + loaded + max(compute, update))
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
# math libraries' buffers (MKL's memory manager held 80 MiB at GPT-J-6B width), the engine's own objects, and
# the blocks glibc's heap keeps once the busiest micro-batch has freed them (execution.retain_host_memory;
# ipuft.engine.hostmem). At that width (one layer, sequence 256, micro-batches of 1 and 4, float32 and bfloat16) on
# the 2-core CI CPU, where bench/width.py prints peak RSS against the plan, peak RSS stayed 0.4-0.5 GiB under
# the plan with this allowance (94-96% of it). The heap's share that grows with the model, one micro-batch's
# blocks under its limit, is added from its measurement (UnitCost.heap_peak_bytes).
CPU_RUNTIME_BYTES = 512 * 2**20

GENERATE_NEW_TOKENS = 64  # the inference view: prompts that fill the sequence but for this many new tokens


def estimate(cfg: DictConfig, parts: ModelParts, hooks: PluginHooks, inference_batch_size: int = 8) -> dict:
    """Everything ``ipuft plan`` prints, as a JSON-ready dict; memory and traffic are per rank. ``inference``:
    the view of ``generate`` with ``inference_batch_size`` prompts of ``sequence_length - 64`` tokens, each
    continued by 64 (see :func:`inference_estimate`)."""
    optimizer = hooks.registrations.build_optimizer(cfg)
    costs = {role: unit_cost(parts, role, cfg, compute_device(cfg)) for role in parts.modules}
    sizes = group_bytes(cfg, parts, optimizer)
    moved = traffic(cfg, parts, sizes)
    variables = sum(_stored(s) for s in sizes.values())
    host_vars = variables if cfg.execution.offload else 0
    acts = activation_peak_bytes(cfg)
    host_acts = acts if cfg.execution.activation_offload else 0
    host_update = updates_on_host(cfg)
    program = []
    for phase in parts.program:
        moves = phase_moves(cfg, parts, phase)
        loads, stores = phase_io(moves, sizes[phase.unit]) if moves is not None else ({}, {})
        program.append({
            "phase": phase.name,
            "stage": parts.program.stage_of(phase).name.lower(),
            "loads": loads if cfg.execution.offload else {},
            "stores": stores if cfg.execution.offload else {},
            "host_update": moves is not None and host_update and phase.updates,
        })
    counts = {role: sum(v.numel for v in parts.variables[role] if v.trainable) for role in parts.variables}
    totals = {role: sum(v.numel for v in parts.variables[role]) for role in parts.variables}
    layers = cfg.model.layers

    def whole_model(per_role: dict[str, int]) -> int:
        return per_role["embeddings"] + layers * per_role["decoder"] + per_role["head"]

    parameters, trainable = whole_model(totals), whole_model(counts)
    return {
        "parameters": parameters,
        "trainable_parameters": trainable,
        "frozen_parameters": parameters - trainable,
        "frozen_saves_bytes": frozen_savings(cfg, parts, optimizer, sizes),
        "data_parallel": cfg.execution.data_parallel,
        "tensor_parallel": cfg.execution.tensor_parallel,
        "rts": bool(cfg.execution.rts),
        "gradient_accumulation": cfg.gradient_accumulation,
        "precision": cfg.model.precision.value,
        "update": recipe(cfg).value,
        "offload": cfg.execution.offload,
        "activation_offload": cfg.execution.activation_offload,
        "optimizer_placement": cfg.execution.optimizer_placement.value,
        "program": program,
        "variables_bytes": {unit: s for unit, s in sizes.items()},
        "variable_bytes": variables,
        "activation_bytes": acts,
        "graph_bytes": graph_bytes(cfg, parts, costs),
        "host_bytes": host_vars + host_acts,
        "device_peak_bytes": device_peak_estimate(cfg, parts, optimizer, sizes, costs),
        # On a CPU device its memory is the host's: what the phases add to the store (a load lends the stored
        # variables), and what the process keeps besides its tensors while it computes.
        "cpu_working_bytes": device_peak_estimate(cfg, parts, optimizer, sizes, costs, lent=True)
                             + CPU_RUNTIME_BYTES + max(c.heap_peak_bytes for c in costs.values()),
        "init_host_bytes": init_host_bytes(cfg, parts),
        "h2d_bytes_per_step": sum(moved["h2d"].values()),
        "d2h_bytes_per_step": sum(moved["d2h"].values()),
        "traffic": moved,
        "flops_per_step": step_flops(cfg, parts, costs).as_dict(),
        "inference": inference_estimate(cfg, parts, inference_batch_size,
                                        max(1, cfg.model.sequence_length - GENERATE_NEW_TOKENS),
                                        min(GENERATE_NEW_TOKENS, cfg.model.sequence_length - 1) or 1),
    }


def inference_estimate(cfg: DictConfig, parts: ModelParts, batch_size: int, prompt_tokens: int,
                       new_tokens: int) -> dict:
    """``generate``'s memory (one process, TP=1): ``batch_size`` prompts of ``prompt_tokens`` tokens continued
    by ``new_tokens``, through :class:`ipuft.engine.inference.LayerMajor`. The device peak is exact: it follows
    the runner's ledger (the passes' largest moment is the prefill or the last decoding step).

    Per unit, the device holds the unit's weights (offloaded) or every weight (not), the batch's hidden
    states, and the key/value cache: one layer's while it runs with ``activation_offload``, every layer's
    otherwise. The head runs on the last position only.
    """
    itemsize = torch.empty((), dtype=compute_dtype(cfg)).element_size()
    m, layers, b = cfg.model, cfg.model.layers, batch_size
    units = {role: _bytes(parts.variables[role]) for role in ("embeddings", "decoder", "head")}
    weights = units["embeddings"] + layers * units["decoder"] + units["head"]
    offload, act_offload = cfg.execution.offload, cfg.execution.activation_offload
    resident = 0 if offload else weights
    load = {role: n if offload else 0 for role, n in units.items()}

    def hidden(t: int) -> int:
        return b * t * m.hidden_size * itemsize

    per_position = kv_cache_bytes_per_position(parts, cfg)

    def cache(t: int) -> int:  # one layer's keys and values for t positions
        return b * t * per_position

    logits = b * m.embedding.vocab_size * itemsize

    def peak(t: int, past: int) -> int:
        """The largest moment of one pass of ``t`` new tokens over ``past`` cached positions."""
        if act_offload:
            moments = [load["embeddings"], load["decoder"] + hidden(t) + cache(past + t),
                       hidden(t) + hidden(1), hidden(1) + load["head"] + logits]
        else:
            caches = layers * cache(past + t)
            moments = [load["embeddings"] + hidden(t), caches + hidden(t) + load["decoder"],
                       caches + hidden(t) + hidden(1), caches + hidden(1) + load["head"] + logits]
        return resident + max(moments)

    passes = [peak(prompt_tokens, 0)] + ([peak(1, prompt_tokens + new_tokens - 2)] if new_tokens > 1 else [])
    positions = prompt_tokens + max(new_tokens - 1, 0)
    return {
        "batch_size": batch_size,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kv_cache_bytes": layers * cache(positions),
        "device_peak_bytes": max(passes),
        "host_bytes": (weights if offload else 0) + (layers * cache(positions) if act_offload else 0),
    }


# Settings that shrink a run's memory, tried one at a time (and all together) when it does not fit.
_REMEDIES = (
    {"execution": {"activation_offload": True}},
    {"execution": {"offload": True}},
    {"model": {"precision": "bfloat16"}, "training": {"stochastic_rounding": True, "master_weights": False}},
)


def machine_memory(cfg: DictConfig) -> dict:
    """This machine's available host memory and, when the run computes on CUDA, the device's free memory; and
    the host memory this process holds now (the interpreter, torch, the plugins: what each rank holds before
    it allocates the model)."""
    host = process = None
    try:
        for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115 (a one-shot read)
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
        for line in open("/proc/self/status").read().splitlines():  # noqa: SIM115
            if line.startswith("VmRSS:"):
                process = int(line.split()[1]) * 1024
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    device = torch.cuda.mem_get_info()[0] if compute_device(cfg).type == "cuda" else None
    return {"host_available_bytes": host, "device_free_bytes": device, "process_bytes": process or 0}


def _needs(cfg: DictConfig, result: dict, memory: dict) -> tuple[int, int | None]:
    """Host bytes (every rank on this machine: its process, its store, and the larger of what filling the store
    adds and, on a CPU device, what its phases add) and device bytes."""
    world = cfg.execution.data_parallel * cfg.execution.tensor_parallel
    rank = memory.get("process_bytes", 0) + result["host_bytes"]
    if memory["device_free_bytes"] is None:
        return world * (rank + max(result["cpu_working_bytes"], result["init_host_bytes"])), None
    return world * (rank + result["init_host_bytes"]), result["device_peak_bytes"]


def _fits(cfg: DictConfig, result: dict, memory: dict) -> bool:
    host, device = _needs(cfg, result, memory)
    return host <= memory["host_available_bytes"] and (device is None or device <= memory["device_free_bytes"])


def fit(cfg: DictConfig, hooks: PluginHooks, result: dict, memory: dict | None = None) -> dict:
    """Whether the planned run fits this machine (every rank of the layout on it), and if not, which of
    a few memory-saving settings, alone or together, would make it fit."""
    from omegaconf import OmegaConf

    from ipuft.engine.model import build_model

    memory = memory or machine_memory(cfg)
    host, device = _needs(cfg, result, memory)
    out = {**memory, "host_needed_bytes": host, "device_needed_bytes": device, "fits": _fits(cfg, result, memory),
           "would_fit_with": []}
    if out["fits"]:
        return out
    changes = [c for c in _REMEDIES if OmegaConf.merge(cfg, c) != cfg]
    together = OmegaConf.to_container(OmegaConf.merge(*changes)) if len(changes) > 1 else None
    for change in [*changes, *([together] if together else [])]:
        trial = OmegaConf.merge(cfg, change)
        if _fits(trial, estimate(trial, build_model(trial, hooks), hooks), memory):
            out["would_fit_with"].append(" ".join(f"{k}={v}" for k, v in _flatten(change)))
    return out


def _flatten(change: dict, prefix: str = "") -> list[tuple[str, object]]:
    items = []
    for key, value in change.items():
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", str(value).lower() if isinstance(value, bool) else value))
    return items


def format_fit(cfg: DictConfig, result: dict) -> str:
    """One line: whether the run fits this machine, and what would make it fit."""
    world = cfg.execution.data_parallel * cfg.execution.tensor_parallel
    ranks = f" ({world} ranks on it)" if world > 1 else ""
    host, available = format_bytes(result["host_needed_bytes"]), format_bytes(result["host_available_bytes"])
    parts = [f"host {host} of {available} available"]
    if result["device_needed_bytes"] is not None:
        device, free = format_bytes(result["device_needed_bytes"]), format_bytes(result["device_free_bytes"])
        parts.append(f"device {device} of {free} free")
    verdict = "fits this machine" if result["fits"] else "does NOT fit this machine"
    line = f"{verdict}{ranks}: {'; '.join(parts)}"
    if not result["fits"]:
        remedies = result["would_fit_with"]
        line += ("; it would fit with " + " | ".join(remedies)) if remedies else \
            "; none of activation offload, offload or bfloat16 makes it fit: add data-parallel machines (RTS)"
    return line


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB, or MiB under 64 MiB."""
    return f"{n / 2**30:,.3f} GiB" if n >= 2**26 else f"{n / 2**20:,.3f} MiB"


def format_flops(n: float) -> str:
    """``n`` floating-point operations (or, with a unit appended by the caller, per second) in G or T."""
    return f"{n / 1e12:,.3f} T" if n >= 1e12 else f"{n / 1e9:,.3f} G"


def format_plan(result: dict) -> str:
    """The human-readable form of :func:`estimate`."""
    lines = [f"step program ({len(result['program'])} phases, GA={result['gradient_accumulation']}, "
             f"DP={result['data_parallel']} × TP={result['tensor_parallel']}, RTS={result['rts']}, "
             f"offload={result['offload']}, activation_offload={result['activation_offload']}, "
             f"optimizer_placement={result['optimizer_placement']}); bytes are per rank:"]
    for p in result["program"]:
        loads = ", ".join(f"{g} {format_bytes(b)}" for g, b in p["loads"].items()) or "-"
        stores = ", ".join(f"{g} {format_bytes(b)}" for g, b in p["stores"].items()) or "-"
        host = "   (updated in host memory)" if p["host_update"] else ""
        lines.append(f"  {p['phase']:<48} load: {loads:<42} store: {stores}{host}".rstrip())
    lines += [
        f"parameters:           {result['parameters']:,}" + (
            f" ({result['trainable_parameters']:,} trainable, {result['frozen_parameters']:,} frozen: "
            f"{format_bytes(result['frozen_saves_bytes'])} of gradients and optimizer state not stored)"
            if result["frozen_parameters"] else ""),
        f"host memory (rank):   {format_bytes(result['host_bytes'])}",
        f"device peak (est.):   {format_bytes(result['device_peak_bytes'])}",
        f"host->device / step:  {format_bytes(result['h2d_bytes_per_step'])}",
        f"device->host / step:  {format_bytes(result['d2h_bytes_per_step'])}",
    ]
    for direction in ("h2d", "d2h"):
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(result["traffic"][direction].items()))
        lines.append(f"  {direction} by kind:        {parts}")
    flops = result["flops_per_step"]
    lines.append(f"compute / step:       {format_flops(flops['model'])} model (forward and backward)"
                 + (f" + {format_flops(flops['recompute'])} recomputed" if flops["recompute"] else ""))
    inf = result["inference"]
    lines += [
        f"generate ({inf['batch_size']} rows together, {inf['prompt_tokens']}-token prompts "
        f"+ {inf['new_tokens']} new; one process, TP=1):",
        f"  device peak:        {format_bytes(inf['device_peak_bytes'])}",
        f"  host memory:        {format_bytes(inf['host_bytes'])} (KV cache {format_bytes(inf['kv_cache_bytes'])})",
    ]
    return "\n".join(lines)
