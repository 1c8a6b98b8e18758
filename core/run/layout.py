"""``execution.recompute`` and ``execution.offload`` set to ``auto`` (the finetune recipe's): the run's plan
chooses its layout before anything is allocated.

Recomputing each layer's forward in its backward and streaming the variables from host memory are what let a
model far larger than the device train; for a model the device holds whole they only cost time (a fifth of
a step's compute is the recompute). So ``auto`` takes the first of these layouts whose plan
(:func:`ipuft.plan.estimate.estimate`) fits this machine (:func:`ipuft.plan.fit.fits`) within
:data:`MARGIN` of its free memory:

1. ``recompute=false, offload=false``: every layer's graph and weights kept on the device (needs
   ``activation_offload=false`` and no RTS);
2. ``recompute=true, offload=false``: the variables resident, each layer recomputed;
3. ``recompute=true, offload=true``: the reference's layout, which every model this program exists for needs,
   and what ``auto`` falls back to.

A key the user set stays as set; only the ``auto`` ones are chosen. With more than one process (DP or TP),
``auto`` takes the last layout without planning: each rank would measure its own free memory, and ranks that
chose differently would not run one program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from ipuft.config import with_values
from ipuft.engine.model import build_model
from ipuft.plan.estimate import estimate
from ipuft.plan.fit import fits, machine_memory, needs
from ipuft.plugins import PluginHooks
from ipuft.units import format_bytes

AUTO = "auto"
MARGIN = 0.8  # the share of the machine's free host and device memory an auto layout may plan to hold
KEYS = ("recompute", "offload")


@dataclass
class LayoutChoice:
    """The layout ``auto`` chose, the line that says which and why, and each layout it planned:
    ``{"recompute", "offload", "device_peak_bytes", "host_bytes", "host_needed_bytes", "device_needed_bytes",
    "fits_with_margin"}`` (what :func:`ipuft.plan.fit.needs` counts, against :data:`MARGIN` of the memory)."""

    recompute: bool
    offload: bool
    line: str
    planned: list[dict] = field(default_factory=list)


def is_auto(cfg: DictConfig) -> bool:
    return any(cfg.execution[key] == AUTO for key in KEYS)


def _candidates(cfg: DictConfig) -> list[tuple[bool, bool]]:
    """The layouts ``(recompute, offload)`` the config allows, the fastest first."""
    ex = cfg.execution
    options = [(r, o) for r in ((False, True) if ex.recompute == AUTO else (ex.recompute,))
               for o in ((False, True) if ex.offload == AUTO else (ex.offload,))]
    allowed = [(r, o) for r, o in options
               if (r or (not o and not ex.activation_offload and not ex.rts))
               and (o or ex.optimizer_placement.value != "host")]
    return sorted(allowed, key=lambda layout: (layout[0], layout[1]))


def resolved(cfg: DictConfig, recompute: bool, offload: bool) -> DictConfig:
    """A read-only copy of ``cfg`` with the layout set."""
    return with_values(cfg, {"execution.recompute": recompute, "execution.offload": offload})


def choose_layout(cfg: DictConfig, hooks: PluginHooks, memory: dict | None = None,
                  every: bool = False) -> tuple[DictConfig, LayoutChoice | None]:
    """``cfg`` with its ``auto`` keys chosen (see the module docstring), and what was chosen (``None`` where
    neither key is ``auto``). ``memory``: :func:`ipuft.plan.fit.machine_memory`'s (this machine's, unless
    given). ``every``: plan every layout the config allows (``ipuft plan``), not only until one fits."""
    if not is_auto(cfg):
        return cfg, None
    ex = cfg.execution
    candidates = _candidates(cfg)
    chosen = [key for key in KEYS if ex[key] == AUTO]

    def choice(recompute: bool, offload: bool, why: str, planned: list[dict]) -> tuple[DictConfig, LayoutChoice]:
        values = {"recompute": recompute, "offload": offload}
        keys = ", ".join(f"execution.{key}={str(values[key]).lower()}" for key in chosen)
        line = f"{keys} (auto: {why}; ipuft plan shows each layout)"
        return resolved(cfg, recompute, offload), LayoutChoice(recompute, offload, line, planned)

    if not candidates:  # the keys set rule every layout out (recompute=false with offload=true): the default
        return choice(True, True, "the other settings allow no faster layout", [])
    world = ex.data_parallel * ex.tensor_parallel
    if world > 1 or len(candidates) == 1:
        why = (f"{world} processes, each of which would measure its own free memory" if world > 1
               else "the other settings allow no faster layout")
        return choice(*candidates[-1], why, [])
    memory = memory or machine_memory(cfg)
    device = memory["device_free_bytes"]
    margin = {**memory, "host_available_bytes": int(memory["host_available_bytes"] * MARGIN),
              "device_free_bytes": None if device is None else int(device * MARGIN)}
    planned, found = [], None
    optimizer = hooks.registrations.build_optimizer(cfg)
    for k, (recompute, offload) in enumerate(candidates):
        last = k == len(candidates) - 1  # the fallback: planned only to be shown
        if not every and (found is not None or last):
            break
        trial = resolved(cfg, recompute, offload)
        result = estimate(trial, build_model(trial, hooks, optimizer), hooks)
        ok = fits(trial, result, margin)
        host, on_device = needs(trial, result, memory)
        planned.append({"recompute": recompute, "offload": offload, "device_peak_bytes": result["device_peak_bytes"],
                        "host_bytes": result["host_bytes"], "host_needed_bytes": host,
                        "device_needed_bytes": on_device, "fits_with_margin": ok})
        if ok and found is None and not last:
            found = planned[-1]
    if found is None:
        return choice(*candidates[-1], f"no faster layout's plan fits within {MARGIN:.0%} of this machine's memory",
                      planned)
    where = (f"device {format_bytes(found['device_needed_bytes'])} of {format_bytes(device)} free"
             if device is not None else
             f"host {format_bytes(found['host_needed_bytes'])} of {format_bytes(memory['host_available_bytes'])} "
             f"available")
    return choice(found["recompute"], found["offload"],
                  f"its plan fits within {MARGIN:.0%} of this machine's memory: {where}", planned)
