"""Whether a planned run fits this machine, what would make it fit, and the plan's human-readable form."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ipuft.engine.model import build_model
from ipuft.kernels import compute_device
from ipuft.plan.estimate import estimate
from ipuft.plugins import PluginHooks
from ipuft.units import format_bytes, format_flops

_REMEDIES = (
    {"execution": {"activation_offload": True}},
    {"execution": {"activation_offload": "disk"}},
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
    return {"host_available_bytes": host, "device_free_bytes": device, "process_bytes": process or 0,
            "disk_free_bytes": _disk_free(cfg)}


def _disk_free(cfg: DictConfig) -> int:
    """Free bytes where ``activation_offload=disk`` would spill: ``execution.spill_dir``, else the run directory
    (``output_dir``, else ``runs/``), or the nearest of their parents that exists."""
    path = Path(cfg.execution.spill_dir or cfg.output_dir or "runs").absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def needs(cfg: DictConfig, result: dict, memory: dict) -> tuple[int, int | None]:
    """Host bytes (every rank on this machine: its process, its store, and the larger of what filling the store
    adds and, on a CPU device, what its phases add) and device bytes."""
    world = cfg.execution.data_parallel * cfg.execution.tensor_parallel
    rank = memory.get("process_bytes", 0) + result["host_bytes"]
    if memory["device_free_bytes"] is None:
        return world * (rank + max(result["cpu_working_bytes"], result["init_host_bytes"])), None
    return world * (rank + result["init_host_bytes"]), result["device_peak_bytes"]


def fits(cfg: DictConfig, result: dict, memory: dict) -> bool:
    """Whether the planned ``result`` of ``cfg`` fits ``memory`` (:func:`machine_memory`'s): host, device, disk."""
    host, device = needs(cfg, result, memory)
    world = cfg.execution.data_parallel * cfg.execution.tensor_parallel
    disk = world * result.get("disk_bytes", 0) <= memory.get("disk_free_bytes", 0) if result.get("disk_bytes") else True
    return host <= memory["host_available_bytes"] and (device is None or device <= memory["device_free_bytes"]) \
        and disk


def fit(cfg: DictConfig, hooks: PluginHooks, result: dict, memory: dict | None = None) -> dict:
    """Whether the planned run fits this machine (every rank of the layout on it), and if not, which of
    a few memory-saving settings, alone or together, would make it fit."""
    memory = memory or machine_memory(cfg)
    host, device = needs(cfg, result, memory)
    out = {**memory, "host_needed_bytes": host, "device_needed_bytes": device, "fits": fits(cfg, result, memory),
           "would_fit_with": []}
    if out["fits"]:
        return out
    changes = [c for c in _REMEDIES if OmegaConf.merge(cfg, c) != cfg]
    together = OmegaConf.to_container(OmegaConf.merge(*changes)) if len(changes) > 1 else None
    for change in [*changes, *([together] if together else [])]:
        trial = OmegaConf.merge(cfg, change)
        if fits(trial, estimate(trial, build_model(trial, hooks), hooks), memory):
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
        line += ("; it would fit with " + " | ".join(remedies)) if remedies else (
            "; none of activation offload (to host or disk), offload or bfloat16 makes it fit: add data-parallel "
            "machines (RTS)")
    return line


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
        *([f"disk (rank):          {format_bytes(result['disk_bytes'])} of activations written and read back "
           f"a step"] if result.get("disk_bytes") else []),
        f"device peak (est.):   {format_bytes(result['device_peak_bytes'])}",
        f"host->device / step:  {format_bytes(result['h2d_bytes_per_step'])}",
        f"device->host / step:  {format_bytes(result['d2h_bytes_per_step'])}",
    ]
    for direction in ("h2d", "d2h"):
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(result["traffic"][direction].items()))
        lines.append(f"  {direction} by kind:        {parts}")
    if (ref := result.get("reference_pass")) is not None:
        lines.append(f"reference pass:       once, before step 1: forward only over every row, "
                     f"{ref['micro_batch_size']} rows at a time, the head by chunks; "
                     f"{ref['host_bytes_per_row']} bytes a row kept in host memory")
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
