"""Where a step's time goes: the breakdown of ``ipuft bench --profile`` and the labels of ``--trace``.

While a :class:`StepProfile` is active (:func:`profiling`), the engine's pieces time themselves into
:data:`CATEGORIES`: each phase by its kind (forward, the head's loss and backward, a backward with its
recompute, an update), and inside a phase the host↔device copies (variable-store loads, prefetches and
saves, activation-buffer reads and writes, the batch) and the collectives (DP/TP reductions and gathers,
the global norm's all-reduce) carved out of it. Time is exclusive: a section nested in another counts for
its own category only. What no section covers (Python between the phases, the loss's mean) is the step's
remainder, reported as ``other``.

On CUDA each section boundary synchronises the device, so that a section's time is that of its work and
not of its launch. This serialises what normally overlaps (the side stream's prefetch with the phase that
computes), so a profiled step takes longer than a plain one; the shares say where the work is.

:class:`PhaseLabels` is the other recorder: it times nothing and synchronises nothing, but opens a
``torch.profiler.record_function`` range named after each phase (``decoder.3:backward``) and each section
(its category), so that a ``torch.profiler`` trace shows the step as it really runs.

With no recorder active nothing is timed or labelled: :func:`section` hands out one shared null context
and :func:`timed` functions call straight through, after one check of a module variable.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TypeVar

import torch

from ipuft.program import Op, Phase

# Category: what the breakdown calls it.
CATEGORIES = {
    "forward": "forward",
    "loss_backward": "loss+backward (head)",
    "backward": "backward with recompute",
    "optimizer": "optimizer",
    "copies": "host<->device copies",
    "collectives": "collectives",
}
OTHER = "other (between phases)"

_NULL = nullcontext()
_ACTIVE: StepProfile | PhaseLabels | None = None
F = TypeVar("F", bound=Callable)


def phase_kind(phase: Phase) -> str:
    """The category of a phase's own time: its gradient op, else its forward, else an update."""
    if Op.LOSS_BACKWARD in phase.ops:
        return "loss_backward"
    if Op.BACKWARD in phase.ops:
        return "backward"
    if Op.FORWARD in phase.ops:
        return "forward"
    return "optimizer"


class StepProfile:
    """Seconds spent in each category while active, summed over every step it saw."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        # Each kind of phase's whole time (its copies and collectives in), by (role, kind), in the order first run.
        self.phases: dict[tuple[str, str], float] = {}
        self._nested: list[float] = []  # for each open section, the time its nested sections took

    def now(self) -> float:
        """``time.perf_counter()`` once the device has finished the work enqueued so far."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def section(self, category: str) -> Iterator[None]:
        """Time the block as ``category``, less what sections nested in it take."""
        start = self.now()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = self.now() - start
            self.seconds[category] += elapsed - self._nested.pop()
            if self._nested:
                self._nested[-1] += elapsed

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Time a phase as its kind (:func:`phase_kind`), and its whole time under its role and kind."""
        kind, start = phase_kind(phase), self.now()
        try:
            with self.section(kind):
                yield
        finally:
            key = (phase.role, kind)
            self.phases[key] = self.phases.get(key, 0.0) + self.now() - start

    def report(self, total: float, steps: int) -> dict:
        """Per step: the measured ``step_s`` (``total`` over ``steps``), each category's seconds and share of
        it, and the remainder no section covered (``other_s``, ``other_share``)."""
        covered = sum(self.seconds.values())
        phases: dict[str, dict[str, float]] = {}
        for (role, kind), seconds in self.phases.items():
            phases.setdefault(role, {})[kind] = seconds / steps
        return {
            "steps": steps,
            "step_s": total / steps,
            "seconds": {c: s / steps for c, s in self.seconds.items()},
            "share": {c: s / total for c, s in self.seconds.items()},
            "other_s": (total - covered) / steps,
            "other_share": (total - covered) / total,
            "phases": phases,
            "phase_order": [list(key) for key in self.phases],  # (role, kind) in the order the step first ran them
        }


class PhaseLabels:
    """A ``torch.profiler.record_function`` range per phase and per section, for a trace; no timing."""

    def section(self, category: str) -> AbstractContextManager[None]:
        return torch.profiler.record_function(category)

    def phase(self, phase: Phase) -> AbstractContextManager[None]:
        return torch.profiler.record_function(phase.name)


def active() -> StepProfile | PhaseLabels | None:
    """The recorder the engine's pieces report to, if any."""
    return _ACTIVE


@contextmanager
def profiling(profile: StepProfile | PhaseLabels) -> Iterator[StepProfile | PhaseLabels]:
    """Make ``profile`` the active recorder for the block (one per process at a time)."""
    global _ACTIVE  # noqa: PLW0603 (the one profile a process records into)
    previous, _ACTIVE = _ACTIVE, profile
    try:
        yield profile
    finally:
        _ACTIVE = previous


def section(category: str) -> AbstractContextManager[None]:
    """Time (or label) the block as ``category`` while a recorder is active; else a shared null context."""
    return _NULL if _ACTIVE is None else _ACTIVE.section(category)


def timed(category: str) -> Callable[[F], F]:
    """Decorate a function so that its calls are timed (or labelled) as ``category`` while a recorder is active."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _ACTIVE is None:
                return fn(*args, **kwargs)
            with _ACTIVE.section(category):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def format_profile(report: dict) -> str:
    """The breakdown as a table: seconds per step and share, by category, then the remainder and the step;
    then each kind of phase by role, with its FLOP/s and their share of the matmul peak, and of the matmul's rate
    between the profiled steps, where the report has them (``ipuft bench``: :func:`ipuft.plan.flops.phase_rates`)."""
    rows = [(CATEGORIES[c], report["seconds"][c], report["share"][c]) for c in CATEGORIES]
    rows += [(OTHER, report["other_s"], report["other_share"]), ("step", report["step_s"], 1.0)]
    lines = [f"where a step's time goes (mean of {report['steps']} profiled steps):"]
    lines += [f"  {name:<26} {seconds:9.4f} s  {share:6.1%}" for name, seconds, share in rows]
    rates = report.get("phase_flops", {})
    lines.append("by phase (whole phases, copies and collectives in; FLOP/s counting the recompute):")
    for role, kind in report["phase_order"]:
        line = f"  {role + ':' + kind:<26} {report['phases'][role][kind]:9.4f} s"
        rate = rates.get(role, {}).get(kind)
        if rate and rate["flops_per_s"]:
            line += f"  {rate['flops_per_s'] / 1e9:10,.1f} GFLOP/s"
            if rate.get("of_peak") is not None:
                line += f"  {rate['of_peak']:6.1%} of the matmul peak"
            if rate.get("of_matmul_rate") is not None:
                line += f", {rate['of_matmul_rate']:6.1%} of its rate between the steps"
        lines.append(line)
    if "matmul_rate" in report:
        samples = ", ".join(f"{r / 1e9:,.1f}" for r in report["matmul_rate"]["samples"])
        lines.append(f"the matmul between the profiled steps: {report['matmul_rate']['flops_per_s'] / 1e9:,.1f} "
                     f"GFLOP/s over all its runs (each half second's: {samples})")
    return "\n".join(lines)
