"""Checkpoint save and load throughput of ipuft against safetensors' own, on a model of about 1 GB of weights
and Adam state (CPU, float32).

    python bench/checkpoint_io.py [--repeats R] [--dir DIR] [KEY=VALUE ...]

Save: ``ipuft.run.resume.save`` (each variable gathered, written and hashed as it comes, every file fsynced,
the manifest from the digests) against the raw write speed of the same bytes: one
``safetensors.torch.save_file`` per file (weights, optimizer state) and an ``os.fsync``. Load: a resume
(the engine built from model.safetensors, then optimizer state and RNG restored, every byte read hashed and
checked against the manifest), and the reading and verifying alone, against ``safetensors.torch.load_file``
of the same two files, each tensor copied out of the mapping into memory of its own, as a resume needs it.
Each figure is GB/s of checkpoint bytes, the median of R runs, with the ratio ipuft / baseline; the runs
alternate, since these machines are noisy. Both loads read files just written, from the page cache. Not a
test.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ipuft.config import load_config
from ipuft.io.checkpoint import OPTIM, WEIGHTS, checkpoint_initializer
from ipuft.plugins import create_plugin_manager
from ipuft.run.resume import restore, save
from ipuft.run.rundir import checkpoint_bytes
from ipuft.run.runtime import build_engine

# 7 decoder layers of 1024 × 4096 (151 MB each with Adam's two moments) and a 2048-token vocabulary: 1.1 GB.
DEFAULTS = ["model.layers=7", "model.hidden_size=1024", "model.intermediate_size=4096", "model.attention.heads=16",
            "model.embedding.vocab_size=2048", "model.sequence_length=8", "training.global_batch_size=1",
            "execution.device=cpu"]


def baseline_save(engine, out: Path) -> None:
    """safetensors' own writer on the same tensors (the store's: full ones in one process), then fsync."""
    from safetensors.torch import save_file

    for file, group in ((WEIGHTS, "fwd"), (OPTIM, "optim")):
        flat = {f"{unit}.{n}": t for unit, w in engine.store.state(group).items() for n, t in w.items()}
        save_file(flat, str(out / file), metadata={"format": "pt"})
        fd = os.open(out / file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def baseline_load(directory: Path) -> int:
    """safetensors' own reader on the same files, each tensor copied into memory of its own (load_file maps the
    file, and a mapped tensor is read only when touched)."""
    from safetensors.torch import load_file

    return sum(len({k: t.clone() for k, t in load_file(str(directory / file)).items()}) for file in (WEIGHTS, OPTIM))


def resume(cfg, hooks, parts, checkpoint: Path):
    """What ``train`` does to resume: build the engine from the weights, then restore the training state."""
    loaded = build_engine(cfg, hooks, parts)
    restore(loaded, cfg, checkpoint, None)
    return loaded


def read(engine, checkpoint: Path) -> None:
    """The reading a resume does, alone: every unit's weights and optimizer state, read and verified."""
    units = engine.program.units()
    for file, group in ((WEIGHTS, "fwd"), (OPTIM, "optim")):
        initial = checkpoint_initializer(checkpoint, file, units)
        for unit in units:
            initial(unit, engine.model.full_specs(unit, group))


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hooks = create_plugin_manager()
    sections = hooks.registrations.config_sections
    cfg = load_config("tiny", [*DEFAULTS, *args.overrides], sections)
    engine = build_engine(cfg, hooks)
    size = checkpoint_bytes(cfg, engine.parts, engine.optimizer)
    work = Path(tempfile.mkdtemp(prefix="ipuft-bench-", dir=args.dir))
    times: dict[str, list[float]] = {"save": [], "save_base": [], "load": [], "read": [], "load_base": []}
    try:
        for r in range(args.repeats):
            root = work / "checkpoints"
            shutil.rmtree(root, ignore_errors=True)
            seconds, checkpoint = timed(save, engine, cfg, root, 1)
            times["save"].append(seconds)
            resumed = load_config("tiny", [*DEFAULTS, *args.overrides, f"checkpoint.load={checkpoint}"], sections)
            gc.collect()
            seconds, loaded = timed(resume, resumed, hooks, engine.parts, checkpoint)
            times["load"].append(seconds)
            del loaded
            gc.collect()
            times["read"].append(timed(read, engine, checkpoint)[0])
            base = work / "baseline"
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            times["save_base"].append(timed(baseline_save, engine, base)[0])
            times["load_base"].append(timed(baseline_load, base)[0])
            gc.collect()
            print(f"run {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint: {size / 1e9:.2f} GB of weights and optimizer state ({cfg.model.layers} layers, hidden "
          f"{cfg.model.hidden_size}), median of {args.repeats}")
    rows = (("save", "save", "save_base", "safetensors save_file + fsync"),
            ("load", "load (resume)", "load_base", "safetensors load_file"),
            ("read", "load (reading and verifying alone)", "load_base", "safetensors load_file"))
    for what, label, base_key, base in rows:
        ours, theirs = size / median[what] / 1e9, size / median[base_key] / 1e9
        print(f"{label}: ipuft {ours:.2f} GB/s, {base} {theirs:.2f} GB/s, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
