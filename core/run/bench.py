"""``ipuft bench``: the reference's ``main()``, one untimed step then timed ones, with the model FLOP/s and MFU
of :mod:`ipuft.plan.flops`; ``--profile`` (where a step's time goes, :mod:`ipuft.profiling`) and
``--trace`` (a ``torch.profiler`` Chrome trace).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig

from ipuft.data.batch import Batch
from ipuft.data.tokens import data_source
from ipuft.engine.phased import PhasedEngine
from ipuft.errors import ConfigError
from ipuft.plan.flops import matmul_rate, phase_rates, run_matmul_peak, run_matmul_shape, step_flops, utilisation
from ipuft.plugins import PluginHooks
from ipuft.precision import compute_dtype
from ipuft.profiling import PhaseLabels, StepProfile, profiling
from ipuft.run.runtime import build_engine
from ipuft.run.train import replica_batch


def benchmark(cfg: DictConfig, hooks: PluginHooks, timed_steps: int = 5, profile: bool = False,
              trace: Path | None = None) -> dict:
    """The reference's ``main()``: one untimed step, then ``timed_steps`` timed steps.

    ``profile``: then as many profiled steps, whose breakdown by category (:mod:`ipuft.profiling`) is
    ``"profile"``; the throughput figures stay those of the plain steps. Before each profiled step and after
    the last, the run's matmul (that of the peak) runs for half a second: their rate over all that time is the
    profile's ``"matmul_rate"``, the matmul's speed in the same minutes as the phases it is set against.
    ``trace``: then one step recorded by ``torch.profiler``, with a range per phase, written there as a Chrome
    trace (checked to be writable before anything is built: :func:`check_trace_path`)."""
    if trace is not None:
        check_trace_path(trace)
    data = data_source(cfg)
    engine = build_engine(cfg, hooks)
    batch = replica_batch(cfg, data, 0, engine.layout)
    lr = cfg.training.optimizer.learning_rate.maximum
    engine.step(batch, lr)
    peak = run_matmul_peak(cfg, engine.device)  # measured before and after the timed steps: the better of both
    durations = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        result = engine.step(batch, lr)
        durations.append(time.perf_counter() - start)
    duration = sum(durations) / len(durations)
    samples = cfg.training.global_batch_size
    flops = step_flops(cfg, engine.parts, device=engine.device)
    peak = run_matmul_peak(cfg, engine.device, before=peak)
    out = {"duration_s": duration, "samples_per_s": samples / duration,
           "tokens_per_s": samples * cfg.model.sequence_length / duration, "loss": result.loss,
           "h2d_bytes": result.h2d_bytes, "d2h_bytes": result.d2h_bytes,
           "device_peak_bytes": result.device_peak_bytes, "device": str(engine.device),
           "spill_written_bytes": result.spill_written_bytes, "spill_read_bytes": result.spill_read_bytes,
           "model_flops_per_step": flops.model, "recompute_flops_per_step": flops.recompute,
           **utilisation(flops, duration, peak["flops_per_s"]), "matmul_peak": peak}
    if profile:
        # Each sample makes its operands afresh and lets them go: held between the steps, they would add to the
        # process's peak memory, which width benches set against the plan.
        shape, dtype = run_matmul_shape(cfg), compute_dtype(cfg)
        out["profile"] = profile_steps(engine, batch, lr, timed_steps,
                                       reference=lambda: matmul_rate(dtype, engine.device, *shape, seconds=0.5))
        out["profile"]["phase_flops"] = phase_rates(flops, out["profile"]["phases"], peak["flops_per_s"],
                                                    out["profile"]["matmul_rate"]["flops_per_s"])
    if trace is not None:
        trace_step(engine, batch, lr, trace)
    engine.close()
    return out


def profile_steps(engine: PhasedEngine, batch: Batch, lr: float, steps: int,
                  reference: Callable[[], tuple[float, float]] | None = None) -> dict:
    """Run ``steps`` steps with a profile active; its report (:meth:`ipuft.profiling.StepProfile.report`)
    against each step's measured time, the device synchronised at both ends.

    ``reference()`` (``(flops, seconds)`` of some work, :func:`ipuft.plan.flops.matmul_rate`) runs before each
    step and after the last, outside the profile; the report's ``"matmul_rate"`` is then their FLOP/s over all
    that time, with each run's own (``"samples"``). Over several ranks, they meet before each step, so that a
    step's time is its own and not the wait for a rank still in its reference run (whose length is a time, not
    an amount of work)."""
    profile = StepProfile(engine.device)
    total, samples = 0.0, []
    if reference is not None:
        samples.append(reference())
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        with profiling(profile):
            start = profile.now()
            engine.step(batch, lr)
            total += profile.now() - start
        if reference is not None:
            samples.append(reference())
    report = profile.report(total, steps)
    if samples:
        report["matmul_rate"] = {"flops_per_s": sum(f for f, _ in samples) / sum(s for _, s in samples),
                                 "samples": [f / s for f, s in samples]}
    return report


def trace_step(engine: PhasedEngine, batch: Batch, lr: float, path: Path) -> None:
    """Record one step with ``torch.profiler`` (CPU, and CUDA when the engine computes there), each phase a
    ``record_function`` range named like ``decoder.3:backward`` (:class:`ipuft.profiling.PhaseLabels`: no
    synchronisation, so the trace shows what overlaps), and write it to ``path`` as a Chrome trace; under
    torchrun each rank writes its own, ``<stem>.rank<N><suffix>``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if engine.layout.distributed:
        path = path.with_name(f"{path.stem}.rank{engine.layout.rank}{path.suffix}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with torch_profile(activities=activities) as recorded, profiling(PhaseLabels()):
        engine.step(batch, lr)
    # Written beside ``path`` and moved there once complete: torch's exporter does not say when it fails to write.
    where = f"--trace {path}"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be written ({exc.strerror or exc})") from None
    try:
        recorded.export_chrome_trace(tmp)
        if os.path.getsize(tmp) == 0:
            raise ConfigError(f"{where}: torch.profiler wrote nothing (is its file system full?)")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a file opened for writing would be, not mkstemp's 0600
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be written ({exc.strerror or exc})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_trace_path(path: Path) -> None:
    """Refuse, in one line, a ``--trace`` path that cannot be written: its directory missing or not writable
    (a file is made there and removed), or the path something other than a regular file."""
    where = f"--trace {path}"
    if not path.parent.is_dir():
        raise ConfigError(f"{where}: its directory does not exist")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        what = "a link" if path.is_symlink() else "not a regular file"
        raise ConfigError(f"{where}: exists and is {what}; give a regular file's path, or a new one")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.stem}.", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be written ({exc.strerror or exc})") from None
