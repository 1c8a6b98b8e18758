"""Functions the distributed tests run on every rank (importable by spawned processes)."""

from __future__ import annotations

from pathlib import Path

import torch


def plain(value):
    """``value`` with every ``str`` subclass (a :class:`~ipuft.program.Unit`, an optimizer ``StateName``) made a
    plain ``str``, so that ``torch.load`` with ``weights_only`` reads it back."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def train_configs(rank: int, configs: dict[str, list[str]], steps: int, out: str, preset: str | None = "tiny") -> None:
    """Train each config (``preset`` with its overrides) for ``steps`` steps; rank 0 saves losses, norms, gathered
    weights and optimizer state, and counters."""
    from ipuft.config import load_config
    from ipuft.data.tokens import data_source
    from ipuft.engine.placement import Placement
    from ipuft.plan.estimate import estimate
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.runtime import build_engine
    from ipuft.run.schedule import learning_rate
    from ipuft.run.train import replica_batch

    reductions = 0
    reduce_gradient = Placement.reduce_gradient

    def counted(self, grad):
        nonlocal reductions
        reductions += 1
        return reduce_gradient(self, grad)

    Placement.reduce_gradient = counted
    hooks = create_plugin_manager()
    for name, overrides in configs.items():
        cfg = load_config(preset, overrides, hooks.registrations.config_sections)
        engine = build_engine(cfg, hooks)
        data = data_source(cfg)
        reductions = 0
        results = [engine.step(replica_batch(cfg, data, s, engine.layout),
                               learning_rate(s, steps, cfg.training.optimizer.learning_rate)) for s in range(steps)]
        per_step = reductions / steps
        weights = engine.model.full_weights()
        planned = estimate(cfg, engine.parts, hooks)
        record = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
                  "traffic": results[-1].traffic, "planned": planned["traffic"],
                  "host_bytes": engine.store.host_bytes(), "planned_host": planned["host_bytes"] - (
                      planned["activation_bytes"] if cfg.execution.activation_offload else 0),
                  "activation_bytes": results[-1].activation_bytes, "planned_activation": planned["activation_bytes"],
                  "reductions_per_step": per_step, "spill_written": results[-1].spill_written_bytes,
                  "planned_disk": planned["disk_bytes"],
                  "spill_dir": engine.buffers.files.dir.name if engine.buffers.files is not None else None,
                  "variables": sum(len(v) for v in engine.model.weights().values())}
        optim = engine.model.full_weights("optim")  # every rank takes part in the gathers
        engine.close()
        torch.save(plain({"weights": weights, "optim": optim, **record} if rank == 0 else record),
                   Path(out) / f"{name}.rank{rank}.pt")


def preference_steps(rank: int, configs: dict[str, list[str]], steps: int, out: str) -> None:
    """Preference steps of each config (no preset) on the pairs of :func:`test_preference.step_batch`; rank 0
    saves losses, norms, metrics and the gathered weights, every rank its traffic and the plan's."""
    from test_preference import Rows, pair_rows, step_batch

    from ipuft.config import load_config
    from ipuft.plan.estimate import estimate
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.reference import row_logps
    from ipuft.run.runtime import build_engine

    hooks = create_plugin_manager()
    for name, overrides in configs.items():
        cfg = load_config(None, overrides, hooks.registrations.config_sections)
        engine = build_engine(cfg, hooks)
        layout = engine.layout
        reference = row_logps(engine.model, Rows(*pair_rows(5, pairs=5)), 4, engine.preference)  # the starting model's
        results = [engine.step(step_batch(s, cfg.execution.micro_batch_size, layout.dp_rank, layout.data_parallel),
                               2e-3) for s in range(steps)]
        record = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
                  "metrics": [r.metrics for r in results], "reference": reference, "traffic": results[-1].traffic,
                  "planned": estimate(cfg, engine.parts, hooks)["traffic"]}
        weights = engine.model.full_weights()
        engine.close()
        torch.save(plain({"weights": weights, **record} if rank == 0 else record), Path(out) / f"{name}.rank{rank}.pt")


def tp_logits(rank: int, overrides: list[str], hf_state: dict, ids: torch.Tensor, out: str) -> None:
    """Forward logits at this layout from the given Hugging Face weights, gathered over TP."""
    from hf_reference import hf_units
    from torch.func import functional_call

    from ipuft.config import load_config
    from ipuft.engine.model import build_model
    from ipuft.engine.variables import placements
    from ipuft.parallel import init_layout
    from ipuft.plugins import create_plugin_manager

    hooks = create_plugin_manager()
    cfg = load_config("tiny", overrides, hooks.registrations.config_sections)
    layout = init_layout(cfg, torch.device("cpu"))
    parts = build_model(cfg, hooks)
    placed = placements(parts, layout, rts=False)
    full = hf_units(parts.modules, cfg.model.layers, hf_state)
    local = {unit: {n: placed[unit.role][n].to_stored(t) for n, t in w.items()} for unit, w in full.items()}
    with torch.no_grad():
        h = functional_call(parts.modules["embeddings"], local["embeddings"], (ids,))
        for n in range(cfg.model.layers):
            h = functional_call(parts.modules["decoder"], local[f"decoder.{n}"], (h,))
        logits = functional_call(parts.modules["head"], local["head"], (h,))
        labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
        loss = functional_call(parts.modules["head"], local["head"], (h, labels))
    torch.save({"logits": logits, "loss": loss}, Path(out) / f"logits.rank{rank}.pt")


def collectives(rank: int, out: str) -> None:
    """Each paired collective, forward and backward, with rank-dependent values (TP group of 2)."""
    import torch.distributed as dist

    from ipuft.parallel import (
        Layout,
        activate,
        copy_to_tensor_parallel,
        gather_from_tensor_parallel,
        max_over_tensor_parallel,
        reduce_from_tensor_parallel,
    )

    dist.init_process_group("gloo")
    activate(Layout(1, 2, rank, tp_group=dist.new_group([0, 1]), dp_group=None))
    r = float(rank + 1)  # 1 on rank 0, 2 on rank 1
    results = {}
    x = torch.full((3,), r, requires_grad=True)
    y = copy_to_tensor_parallel(x)
    (y * r).sum().backward()  # local gradient r; all-reduced: 1 + 2 = 3
    results["copy"] = (y.detach(), x.grad.clone())
    x = torch.full((3,), r, requires_grad=True)
    y = reduce_from_tensor_parallel(x)  # 1 + 2 = 3 on both
    (y * r).sum().backward()  # gradient passes through: r
    results["reduce"] = (y.detach(), x.grad.clone())
    x = torch.full((2, 2), r, requires_grad=True)
    y = gather_from_tensor_parallel(x)  # [[1, 1, 2, 2], ...]
    (y * torch.arange(4.0)).sum().backward()  # this rank's slice of [0, 1, 2, 3]
    results["gather"] = (y.detach(), x.grad.clone())
    results["max"] = max_over_tensor_parallel(torch.tensor([r, 3.0 - r]))
    torch.save(plain(results), Path(out) / f"collectives.rank{rank}.pt")


def train_run(rank: int, overrides: list[str]) -> None:
    """``ipuft train`` on every rank, in process."""
    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.train import train

    hooks = create_plugin_manager()
    train(load_config("tiny", overrides, hooks.registrations.config_sections), hooks, progress=False)


def hf_load(rank: int, overrides: list[str], out: str) -> None:
    """Load a Hugging Face directory into this rank's shards; rank 0 saves the gathered weights."""
    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.runtime import build_engine

    hooks = create_plugin_manager()
    engine = build_engine(load_config(None, overrides, hooks.registrations.config_sections), hooks)
    stored = sum(t.numel() for w in engine.model.weights().values() for t in w.values())
    full = engine.model.full_weights()
    torch.save(plain({"stored": stored, "weights": full if rank == 0 else None}), Path(out) / f"hf.rank{rank}.pt")


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def save_memory(rank: int, overrides: list[str], out: str) -> None:
    """Build the engine and save once, then measure the host memory the next checkpoint save adds on this rank:
    the peak resident set (VmHWM, reset just before the save) over the resident set before it. Saves it, with the bytes of the
    largest unit's full weights and optimizer state, as ``memory.rank<N>.json``."""
    import gc
    import json

    import ipuft.io.checkpoint  # noqa: F401 (imported now, not during the measured save)
    from ipuft.config import load_config
    from ipuft.engine.variables import optimizer_state_specs
    from ipuft.plugins import create_plugin_manager
    from ipuft.precision import Recipe
    from ipuft.run.resume import save
    from ipuft.run.runtime import build_engine

    hooks = create_plugin_manager()
    cfg = load_config("tiny", overrides, hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    units = engine.program.units()

    def unit_bytes(unit: str) -> int:
        variables = engine.parts.variables[unit.role]
        state = optimizer_state_specs(variables, engine.optimizer, engine.model.recipe is Recipe.master)
        return sum(v.nbytes for v in variables) + sum(s.nbytes for s in state)

    # A first save pays once per process for what the collectives set up (Gloo's buffers and threads, their
    # malloc arenas: about 16 MB at four ranks, whatever the model); the bound is on what every save adds.
    save(engine, cfg, Path(out) / "warm-up", 1)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set restarts from the current one
    before = _status_bytes("VmRSS")
    save(engine, cfg, Path(out) / "checkpoints", 1)
    extra = _status_bytes("VmHWM") - before
    record = {"extra": extra, "unit_bytes": max(unit_bytes(u) for u in units),
              "checkpoint_bytes": sum(unit_bytes(u) for u in units), "store_bytes": engine.store.variable_bytes()}
    (Path(out) / f"memory.rank{rank}.json").write_text(json.dumps(record))


def bench_profile(rank: int, overrides: list[str], out: str) -> None:
    """``ipuft bench --profile --trace OUT/step.json`` on every rank, in process; each rank saves its breakdown
    (and writes its trace)."""
    import json

    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.bench import benchmark

    hooks = create_plugin_manager()
    result = benchmark(load_config("tiny", overrides, hooks.registrations.config_sections), hooks, timed_steps=2,
                       profile=True, trace=Path(out) / "step.json")
    (Path(out) / f"profile.rank{rank}.json").write_text(json.dumps(result["profile"]))
