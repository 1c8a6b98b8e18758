"""Model FLOPs: what one optimizer step computes, counted from the real shapes on the meta device, and the
matmul rate it is measured against (``ipuft plan``, ``ipuft bench``, ``metrics.jsonl``).

Each unit's forward, backward and recompute are counted once on the meta device (:mod:`ipuft.plan.measure`)
by ``torch.utils.flop_counter.FlopCounterMode``, which counts the matmuls (and attention, which on the meta
device runs as its matmuls: dense ``T × T`` scores, as MFU is usually counted, without the causal half a
kernel may skip). The step program then says how often each runs: every micro-batch's forward and
backward are the *model* FLOPs, what any implementation of the step must compute; the forward a backward
recomputes (``execution.recompute``) is counted apart, as *recompute* FLOPs. Elementwise work (norms,
activations, the optimizer) is not counted, as usual.

Model FLOPs utilisation (MFU) is model FLOP/s over a matmul rate: ``ipuft bench`` measures one itself, a
``[tokens, hidden] × [hidden, intermediate / TP]`` matmul (the shape of a decoder's widest projection at the
run's micro-batch) in the run's dtype on the run's device, so that it is the peak this machine reaches at
this width, not a datasheet's. Counting the recompute too gives the hardware FLOPs utilisation (HFU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from ipuft.engine.model import ModelParts
from ipuft.plan.measure import UnitCost, unit_cost
from ipuft.precision import compute_dtype
from ipuft.program import Op


@dataclass
class StepFlops:
    """One optimizer step's FLOPs on one rank: ``model`` (every forward and backward), ``recompute`` (the
    forwards the backwards recompute), and both by role and phase kind (``forward``, ``loss_backward``,
    ``backward``), as ``{role: {kind: (model, recompute)}}``."""

    model: int = 0
    recompute: int = 0
    by_phase: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)

    def add(self, role: str, kind: str, model: int, again: int) -> None:
        done = self.by_phase.setdefault(role, {}).get(kind, (0, 0))
        self.by_phase[role][kind] = (done[0] + model, done[1] + again)
        self.model += model
        self.recompute += again

    def as_dict(self) -> dict:
        return {"model": self.model, "recompute": self.recompute,
                "by_phase": {role: {kind: {"model": m, "recompute": r} for kind, (m, r) in kinds.items()}
                             for role, kinds in self.by_phase.items()}}


def step_flops(cfg: DictConfig, parts: ModelParts, costs: dict[str, UnitCost] | None = None,
               device: torch.device | str = "cpu") -> StepFlops:
    """Every FLOP of one optimizer step on this rank, by the step program: each phase's ops over the
    gradient-accumulation micro-batches (``costs``: each role's :func:`ipuft.plan.measure.unit_cost`, measured here
    on ``device`` unless given)."""
    per_unit = costs or {role: unit_cost(parts, role, cfg, device) for role in parts.modules}
    ga = cfg.gradient_accumulation
    total = StepFlops()
    for phase in parts.program:
        unit = per_unit[phase.role]
        for op in phase.ops:
            if op is Op.FORWARD:
                total.add(phase.role, "forward", ga * unit.forward, 0)
            elif op is Op.LOSS_BACKWARD:
                total.add(phase.role, "loss_backward", ga * (unit.forward + unit.backward), 0)
            elif op is Op.BACKWARD:
                again = unit.recompute if cfg.execution.recompute else 0
                total.add(phase.role, "backward", ga * unit.backward, ga * again)
    return total


def _matmul_timer(dtype: torch.dtype, device: torch.device | str, m: int, k: int, n: int) -> Callable[[], float]:
    """A function that runs one ``[m, k] × [k, n]`` matmul in ``dtype`` on ``device`` and returns its seconds
    (the device synchronised at both ends), after one warm-up run. Into the same output each time: the kernel's
    own rate, not that of a fresh output, which a CPU faults in page by page at a cost that varies run to run."""
    device = torch.device(device)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    run()
    return run


def _repeated(run: Callable[[], float], seconds: float) -> list[float]:
    """``run()``'s seconds, at least three times and for about ``seconds`` in all."""
    # The total kept as it grows: summing the list at each run was quadratic in the runs, and a tiny model's matmul
    # runs hundreds of thousands of times a second (``ipuft bench --profile`` on the tiny preset: 70 s, 35 s of it sums)
    times: list[float] = []
    total = 0.0
    while len(times) < 3 or total < seconds:
        times.append(run())
        total += times[-1]
    return times


def matmul_peak(dtype: torch.dtype, device: torch.device | str, m: int, k: int, n: int,
                seconds: float = 1.0) -> float:
    """The FLOP/s of an ``[m, k] × [k, n]`` matmul in ``dtype`` on ``device``: the best of repeated runs
    (at least three, for about ``seconds`` in all) after one warm-up."""
    return 2.0 * m * k * n / min(_repeated(_matmul_timer(dtype, device, m, k, n), seconds))


def matmul_rate(dtype: torch.dtype, device: torch.device | str, m: int, k: int, n: int,
                seconds: float = 1.0) -> tuple[float, float]:
    """``(flops, seconds)`` of repeated ``[m, k] × [k, n]`` matmuls (at least three, for about ``seconds`` in all)
    after one warm-up: their rate over the whole time, not their best, for comparing with work that ran in
    the same minutes (a machine shared with other work changes speed from one second to the next)."""
    times = _repeated(_matmul_timer(dtype, device, m, k, n), seconds)
    return 2.0 * m * k * n * len(times), sum(times)


def run_matmul_shape(cfg: DictConfig) -> tuple[int, int, int]:
    """The run's representative matmul ``(m, k, n)``: a micro-batch's tokens through the MLP's first projection
    (this rank's share of it under TP)."""
    tokens = cfg.execution.micro_batch_size * cfg.model.sequence_length
    return tokens, cfg.model.hidden_size, cfg.model.intermediate_size // cfg.execution.tensor_parallel


def run_matmul_peak(cfg: DictConfig, device: torch.device | str, seconds: float = 1.0,
                    before: dict | None = None) -> dict:
    """:func:`matmul_peak` at the run's width (:func:`run_matmul_shape`): ``{"flops_per_s", "shape", "dtype"}``;
    with ``before`` (this function's result earlier in the run), the better of the two: a machine shared with
    other work runs at different speeds from one minute to the next, and a peak is the best it reaches."""
    shape = run_matmul_shape(cfg)
    dtype = compute_dtype(cfg)
    rate = matmul_peak(dtype, device, *shape, seconds=seconds)
    if before is not None:
        rate = max(rate, before["flops_per_s"])
    return {"flops_per_s": rate, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def phase_rates(flops: StepFlops, seconds: dict[str, dict[str, float]], peak: float | None = None,
                matmul: float | None = None) -> dict:
    """Each profiled kind of phase's FLOP/s, counting its recompute (``seconds``: a profile's ``phases``, per step,
    ``{role: {kind: seconds}}``), their share of the matmul ``peak`` (``of_peak``) and of the ``matmul``'s rate
    in the same minutes (``of_matmul_rate``, :func:`matmul_rate`), as ``{role: {kind: {...}}}``."""
    rates: dict[str, dict[str, dict]] = {}
    for role, kinds in seconds.items():
        for kind, spent in kinds.items():
            model, again = flops.by_phase.get(role, {}).get(kind, (0, 0))
            rate = (model + again) / spent if spent > 0 else 0.0
            rates.setdefault(role, {})[kind] = {"flops_per_s": rate, "of_peak": rate / peak if peak else None,
                                                "of_matmul_rate": rate / matmul if matmul else None}
    return rates


def utilisation(flops: StepFlops, step_seconds: float, peak: float | None = None) -> dict:
    """One step's FLOP/s: ``model_flops_per_s`` and ``recompute_flops_per_s``, and with a matmul ``peak`` the
    model FLOPs utilisation (``mfu``) and, counting the recompute, the hardware FLOPs utilisation (``hfu``)."""
    model, again = flops.model / step_seconds, flops.recompute / step_seconds
    out = {"model_flops_per_s": model, "recompute_flops_per_s": again}
    if peak:
        out.update(mfu=model / peak, hfu=(model + again) / peak)
    return out
