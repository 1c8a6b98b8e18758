"""``ipuft plan``: the step program with what each phase moves, and a memory and traffic estimate, all
computed from the real variable shapes without allocating anything (components are on the meta device).

Traffic per optimizer step is exact: the engine's counters must equal it. The device peak is an estimate:
it adds the largest phase's variables, gradients, resident activations, and one micro-batch's working
activations of its layer (measured by running the layer on the meta device).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from omegaconf import DictConfig
from torch.func import functional_call

from ipuft.components import VariableSpec
from ipuft.engine import optimizer_state_specs, placements, unit_role
from ipuft.model import ModelParts
from ipuft.optim import Optimizer
from ipuft.parallel import Layout
from ipuft.plugins import PluginHooks
from ipuft.program import Op

TOKEN_BYTES = torch.empty((), dtype=torch.int64).element_size()


def _bytes(specs: list[VariableSpec]) -> int:
    return sum(s.nbytes for s in specs)


def rank_layout(cfg: DictConfig) -> Layout:
    """The layout of rank 0 of the configured DP × TP grid (sizes only; no process groups)."""
    return Layout(cfg.execution.data_parallel, cfg.execution.tensor_parallel)


def group_bytes(cfg: DictConfig, parts: ModelParts, optimizer: Optimizer) -> dict[str, dict[str, int]]:
    """Bytes one rank stores of each variable group of each unit (``grad`` only where the program stores
    gradients): its TP shard, and with RTS its 1/DP slice of that."""
    stores_grad = parts.program.grad_units()
    placed = placements(parts, rank_layout(cfg), bool(cfg.execution.rts))
    out = {}
    for unit in parts.program.units():
        role = unit_role(unit)
        stored = [p.stored_spec() for p in placed[role].values()]
        sizes = {"fwd": _bytes(stored), "optim": _bytes(optimizer_state_specs(stored, optimizer))}
        sizes["grad"] = sizes["fwd"] if unit in stores_grad else 0
        out[unit] = sizes
    return out


def activation_bytes(cfg: DictConfig) -> int:
    """One micro-batch's layer-boundary activation ``x[n][mb]`` (float32)."""
    return cfg.execution.micro_batch_size * cfg.model.sequence_length * cfg.model.hidden_size * 4


def working_bytes(parts: ModelParts, role: str, cfg: DictConfig) -> int:
    """Bytes autograd saves for one micro-batch of one unit of ``role``, measured on the meta device."""
    mbs, seq, hidden = cfg.execution.micro_batch_size, cfg.model.sequence_length, cfg.model.hidden_size
    params = {v.name: torch.empty(v.shape, dtype=v.dtype, device="meta", requires_grad=True)
              for v in parts.modules[role].variable_specs()}
    ids = torch.zeros(mbs, seq, dtype=torch.int64, device="meta")
    x = torch.empty(mbs, seq, hidden, device="meta", requires_grad=True)
    args = {"embeddings": (ids,), "decoder": (x,), "head": (x, ids)}[role]
    excluded = {id(t) for t in (*params.values(), x)}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if id(t) not in excluded:
            excluded.add(id(t))
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(parts.modules[role], params, args)
    return total


def traffic(cfg: DictConfig, parts: ModelParts, sizes: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Host↔device bytes of one optimizer step, per category, as the engine moves them."""
    h2d: dict[str, int] = defaultdict(int)
    d2h: dict[str, int] = defaultdict(int)
    ga = cfg.gradient_accumulation
    h2d["data"] = 2 * ga * cfg.execution.micro_batch_size * cfg.model.sequence_length * TOKEN_BYTES
    act = activation_bytes(cfg)
    for phase in parts.program:
        if cfg.execution.offload:
            for group in phase.loads:
                h2d[group] += sizes[phase.unit][group]
            for group in phase.stores:
                d2h[group] += sizes[phase.unit][group]
        if cfg.execution.activation_offload:
            reads, writes = _activation_io(parts, phase)
            h2d["activation"] += reads * ga * act
            d2h["activation"] += writes * ga * act
    return {"h2d": dict(h2d), "d2h": dict(d2h)}


def _activation_io(parts: ModelParts, phase) -> tuple[int, int]:
    """How many activation rows a phase reads and writes (each row is GA micro-batches)."""
    x_in, _ = parts.program.activation_rows(phase)
    reads = writes = 0
    for op in phase.ops:
        if op is Op.FORWARD:
            reads += x_in is not None
            writes += 1
        elif op is Op.LOSS_BACKWARD:
            reads, writes = reads + 1, writes + 1
        elif op is Op.BACKWARD:
            reads += 1 + (x_in is not None)
            writes += x_in is not None
    return reads, writes


def device_peak_estimate(cfg: DictConfig, parts: ModelParts, sizes: dict[str, dict[str, int]]) -> int:
    """The largest phase's resident bytes: see the module docstring."""
    ga, act = cfg.gradient_accumulation, activation_bytes(cfg)
    layers = cfg.model.layers
    resident_vars = 0 if cfg.execution.offload else sum(sum(s.values()) for s in sizes.values())
    working = {role: working_bytes(parts, role, cfg) for role in ("embeddings", "decoder", "head")}
    # Offloaded: one row in, one out and a gradient in flight; else the x rows of every layer boundary, and dx.
    acts = 3 * act if cfg.execution.activation_offload else (layers + 2) * ga * act
    peak = 0
    for phase in parts.program:
        unit = sizes[phase.unit]
        loaded = sum(unit[g] for g in phase.loads) if cfg.execution.offload else 0
        grads = unit["fwd"] if phase.computes_gradient and (cfg.execution.offload or not unit["grad"]) else 0
        phase_peak = resident_vars + loaded + grads + (acts + working[phase.role] if phase.computes else 0)
        peak = max(peak, phase_peak)
    return peak


def estimate(cfg: DictConfig, parts: ModelParts, hooks: PluginHooks) -> dict:
    """Everything ``ipuft plan`` prints, as a JSON-ready dict; memory and traffic are per rank."""
    optimizer = hooks.registrations.build_optimizer(cfg)
    sizes = group_bytes(cfg, parts, optimizer)
    moved = traffic(cfg, parts, sizes)
    host_vars = sum(sum(s.values()) for s in sizes.values()) if cfg.execution.offload else 0
    host_acts = 2 * (cfg.model.layers + 1) * cfg.gradient_accumulation * activation_bytes(cfg) \
        if cfg.execution.activation_offload else 0
    program = []
    for phase in parts.program:
        program.append({
            "phase": phase.name,
            "stage": parts.program.stage_of(phase).name.lower(),
            "loads": {g: sizes[phase.unit][g] for g in phase.loads} if cfg.execution.offload else {},
            "stores": {g: sizes[phase.unit][g] for g in phase.stores} if cfg.execution.offload else {},
        })
    parameters = sum(v.numel for role in ("embeddings", "head") for v in parts.variables[role]) + \
        cfg.model.layers * sum(v.numel for v in parts.variables["decoder"])
    return {
        "parameters": parameters,
        "data_parallel": cfg.execution.data_parallel,
        "tensor_parallel": cfg.execution.tensor_parallel,
        "rts": bool(cfg.execution.rts),
        "gradient_accumulation": cfg.gradient_accumulation,
        "offload": cfg.execution.offload,
        "activation_offload": cfg.execution.activation_offload,
        "program": program,
        "variables_bytes": {unit: s for unit, s in sizes.items()},
        "host_bytes": host_vars + host_acts,
        "device_peak_bytes": device_peak_estimate(cfg, parts, sizes),
        "h2d_bytes_per_step": sum(moved["h2d"].values()),
        "d2h_bytes_per_step": sum(moved["d2h"].values()),
        "traffic": moved,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:,.3f} GiB" if n >= 2**26 else f"{n / 2**20:,.3f} MiB"


def format_plan(result: dict) -> str:
    """The human-readable form of :func:`estimate`."""
    lines = [f"step program ({len(result['program'])} phases, GA={result['gradient_accumulation']}, "
             f"DP={result['data_parallel']} × TP={result['tensor_parallel']}, RTS={result['rts']}, "
             f"offload={result['offload']}, activation_offload={result['activation_offload']}); "
             f"bytes are per rank:"]
    for p in result["program"]:
        loads = ", ".join(f"{g} {_gib(b)}" for g, b in p["loads"].items()) or "-"
        stores = ", ".join(f"{g} {_gib(b)}" for g, b in p["stores"].items()) or "-"
        lines.append(f"  {p['phase']:<48} load: {loads:<42} store: {stores}")
    lines += [
        f"parameters:           {result['parameters']:,}",
        f"host memory (rank):   {_gib(result['host_bytes'])}",
        f"device peak (est.):   {_gib(result['device_peak_bytes'])}",
        f"host->device / step:  {_gib(result['h2d_bytes_per_step'])}",
        f"device->host / step:  {_gib(result['d2h_bytes_per_step'])}",
    ]
    for direction in ("h2d", "d2h"):
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(result["traffic"][direction].items()))
        lines.append(f"  {direction} by kind:        {parts}")
    return "\n".join(lines)
