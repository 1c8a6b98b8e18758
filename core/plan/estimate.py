"""``ipuft plan``: the step program with what each phase moves and holds, and a memory and traffic estimate,
all computed from the real variable shapes without allocating anything (components are on the meta device).

Traffic per optimizer step is exact: the engine's counters must equal it. Memory comes from
:mod:`ipuft.plan.memory`: each phase's device holdings, from the units' measured costs
(:mod:`ipuft.plan.measure`). Whether the run fits this machine is :mod:`ipuft.plan.fit`'s.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from omegaconf import DictConfig

from ipuft.engine.cuts import step_shape
from ipuft.engine.model import ModelParts
from ipuft.plan.flops import step_flops
from ipuft.plan.measure import UnitCost, kv_cache_layers, packs_examples, unit_cost
from ipuft.plan.memory import (
    CPU_RUNTIME_BYTES,
    activation_peak_bytes,
    compute_device,
    device_peak_estimate,
    frozen_savings,
    graph_bytes,
    group_bytes,
    init_host_bytes,
    phase_io,
    phase_memory,
    phase_moves,
    specs_bytes,
    stored_bytes,
)
from ipuft.plugins import PluginHooks
from ipuft.precision import compute_dtype, recipe
from ipuft.preference import PreferenceLoss

TOKEN_BYTES = torch.empty((), dtype=torch.int64).element_size()
REFERENCE_BYTES = torch.empty((), dtype=torch.float32).element_size()
GENERATE_NEW_TOKENS = 64  # the inference view: prompts that fill the sequence but for this many new tokens


def traffic(cfg: DictConfig, parts: ModelParts, sizes: dict[str, dict[str, int]],
            costs: dict[str, UnitCost] | None = None) -> dict[str, dict[str, int]]:
    """Host↔device bytes of one optimizer step, per category: what :meth:`~ipuft.program.StepProgram.moves`
    says each phase moves, summed as the engine's counters count it, and (with the units' ``costs``) the inputs
    a head's gradient by vocabulary slices keeps in host memory, sent once and brought back once a slice."""
    h2d: dict[str, int] = defaultdict(int)
    d2h: dict[str, int] = defaultdict(int)
    ga = cfg.gradient_accumulation
    per_token = 3 if packs_examples(cfg) else 2  # input ids, labels, and the positions of packed examples
    h2d["data"] = per_token * ga * cfg.execution.micro_batch_size * cfg.model.sequence_length * TOKEN_BYTES
    if PreferenceLoss.of(cfg) is not None:  # each row's reference log-prob
        h2d["data"] += ga * cfg.execution.micro_batch_size * REFERENCE_BYTES
    act = step_shape(cfg).stored_activation_bytes
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
        if moves.carries and "grad" in step_shape(cfg).streamed_groups(phase, moves):  # rows added in host memory
            tokens = cfg.execution.micro_batch_size * cfg.model.sequence_length
            d2h["grad"] += ga * tokens * (cfg.model.hidden_size * step_shape(cfg).itemsize + TOKEN_BYTES)
        cost = costs.get(phase.role) if costs is not None and phase.computes_gradient else None
        if cost is not None and cost.stash_bytes:
            d2h["activation"] += ga * cost.stash_bytes
            h2d["activation"] += ga * cost.stash_bytes * cost.stash_fetches
    return {"h2d": dict(h2d), "d2h": dict(d2h)}


def estimate(cfg: DictConfig, parts: ModelParts, hooks: PluginHooks, inference_batch_size: int = 8) -> dict:
    """Everything ``ipuft plan`` prints, as a JSON-ready dict; memory and traffic are per rank. ``inference``:
    the view of ``generate`` with ``inference_batch_size`` prompts of ``sequence_length - 64`` tokens, each
    continued by 64 (see :func:`inference_estimate`)."""
    optimizer = hooks.registrations.build_optimizer(cfg)
    kv_layers = kv_cache_layers(parts, cfg)  # how each layer attends: its layer kind, and its cache
    costs = {role: unit_cost(parts, role, cfg, compute_device(cfg), kv_layers) for role in parts.modules}
    sizes = group_bytes(cfg, parts, optimizer)
    moved = traffic(cfg, parts, sizes, costs)
    variables = sum(stored_bytes(s) for s in sizes.values())
    host_vars = variables if cfg.execution.offload else 0
    acts = activation_peak_bytes(cfg)
    host_acts = acts if cfg.execution.activation_offload else 0
    host_update = step_shape(cfg).host_update
    holds = phase_memory(cfg, parts, optimizer, sizes, costs)
    program = []
    for phase in parts.program:
        moves = phase_moves(cfg, parts, phase)
        loads, stores = phase_io(moves, sizes[phase.unit]) if moves is not None else ({}, {})
        held = holds[phase.name]
        program.append({
            "phase": phase.name,
            "stage": parts.program.stage_of(phase).name.lower(),
            "loads": loads if cfg.execution.offload else {},
            "stores": stores if cfg.execution.offload else {},
            "host_update": moves is not None and host_update and phase.updates,
            "device": {"loaded": held.loaded, "compute": held.compute, "update": held.update},
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
        "disk_bytes": step_shape(cfg).spill_bytes,  # activation_offload=disk: written and read back each step
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
        "reference_pass": reference_pass(cfg),
        "inference": inference_estimate(cfg, parts, inference_batch_size,
                                        max(1, cfg.model.sequence_length - GENERATE_NEW_TOKENS),
                                        min(GENERATE_NEW_TOKENS, cfg.model.sequence_length - 1) or 1, kv_layers),
    }


def reference_pass(cfg: DictConfig) -> dict | None:
    """A DPO or IPO run's reference pass (:mod:`ipuft.run.reference`): once, before the first step, a forward-only
    pass over every training and validation row in micro-batches of ``execution.micro_batch_size`` rows (the
    evaluation's pass, layer-major), whose result stays in host memory at ``REFERENCE_BYTES`` a row. None for
    any other run."""
    spec = PreferenceLoss.of(cfg)
    if spec is None or not spec.uses_reference:
        return None
    return {"micro_batch_size": cfg.execution.micro_batch_size, "host_bytes_per_row": REFERENCE_BYTES}


def inference_estimate(cfg: DictConfig, parts: ModelParts, batch_size: int, prompt_tokens: int,
                       new_tokens: int, kv_layers: list[tuple[int, int | None]] | None = None) -> dict:
    """``generate``'s memory (one process, TP=1): ``batch_size`` prompts of ``prompt_tokens`` tokens continued
    by ``new_tokens``, through :class:`ipuft.engine.inference.LayerMajor`. The device peak is exact: it follows
    the runner's ledger (the passes' largest moment is the prefill or the last decoding step).

    Per unit, the device holds the unit's weights (offloaded) or every weight (not), the batch's hidden
    states, and the key/value cache: one layer's while it runs with ``activation_offload``, every layer's
    otherwise; a layer with a window keeps its last ``W`` positions (``kv_layers``: each layer's bytes per
    position and window, :func:`ipuft.plan.measure.kv_cache_layers`). The head runs on the last position only.
    """
    itemsize = torch.empty((), dtype=compute_dtype(cfg)).element_size()
    m, layers, b = cfg.model, cfg.model.layers, batch_size
    units = {role: specs_bytes(parts.variables[role]) for role in ("embeddings", "decoder", "head")}
    weights = units["embeddings"] + layers * units["decoder"] + units["head"]
    offload, act_offload = cfg.execution.offload, cfg.execution.activation_offload
    resident = 0 if offload else weights
    # A unit loads its own weights and the tied ones it uses (their owners').
    load = {role: specs_bytes(parts.uses(role)) if offload else 0 for role in units}

    def hidden(t: int) -> int:
        return b * t * m.hidden_size * itemsize

    kv_layers = kv_layers or kv_cache_layers(parts, cfg)

    def caches(t: int) -> list[int]:  # each layer's keys and values after t positions (a window keeps its last W)
        return [b * (t if window is None else min(t, window)) * per_position for per_position, window in kv_layers]

    logits = b * m.embedding.vocab_size * itemsize

    def peak(t: int, past: int) -> int:
        """The largest moment of one pass of ``t`` new tokens over ``past`` cached positions."""
        if act_offload:
            moments = [load["embeddings"], load["decoder"] + hidden(t) + max(caches(past + t)),
                       hidden(t) + hidden(1), hidden(1) + load["head"] + logits]
        else:
            cached = sum(caches(past + t))  # the last layer's moment: every layer's cache grown
            moments = [load["embeddings"] + hidden(t), cached + hidden(t) + load["decoder"],
                       cached + hidden(t) + hidden(1), cached + hidden(1) + load["head"] + logits]
        return resident + max(moments)

    passes = [peak(prompt_tokens, 0)] + ([peak(1, prompt_tokens + new_tokens - 2)] if new_tokens > 1 else [])
    positions = prompt_tokens + max(new_tokens - 1, 0)
    return {
        "batch_size": batch_size,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kv_cache_bytes": sum(caches(positions)),
        "device_peak_bytes": max(passes),
        "host_bytes": (weights if offload else 0) + (sum(caches(positions)) if act_offload else 0),
    }


# Settings that shrink a run's memory, tried one at a time (and all together) when it does not fit.
