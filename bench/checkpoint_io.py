"""Checkpoint save and load throughput of ipuft against safetensors' own, on a model of about 1 GB of weights
and Adam state (CPU, float32).

    python bench/checkpoint_io.py [--repeats R] [--dir DIR] [KEY=VALUE ...]

Save: ``ipuft.train.save`` (each variable gathered, written and hashed as it comes, every file fsynced,
the manifest from the digests) against the raw write speed of the same bytes: one
``safetensors.torch.save_file`` per file (weights, optimizer state) and an ``os.fsync``. Load: a resume
(the engine built from model.safetensors, then optimizer state and RNG restored, every byte read hashed and
checked against the manifest) against ``safetensors.torch.load_file`` of the same two files. Each figure
is GB/s of checkpoint bytes, the median of R runs, with the ratio ipuft / baseline; the runs alternate,
since these machines are noisy. Both loads read files just written, from the page cache. Not a test.
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

from ipuft.checkpoint import OPTIM, WEIGHTS
from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.train import build_engine, checkpoint_bytes, restore, save

# 7 decoder layers of 1024 × 4096 (151 MB each with Adam's two moments) and a 2048-token vocabulary: 1.1 GB.
DEFAULTS = ["model.layers=7", "model.hidden_size=1024", "model.intermediate_size=4096", "model.attention.heads=16",
            "model.embedding.vocab_size=2048", "model.sequence_length=8", "training.global_batch_size=1",
            "execution.device=cpu", "checkpoint.to_keep=null"]


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
    from safetensors.torch import load_file

    return sum(len(load_file(str(directory / file))) for file in (WEIGHTS, OPTIM))


def resume(cfg, hooks, parts, checkpoint: Path):
    """What ``train`` does to resume: build the engine from the weights, then restore the training state."""
    loaded = build_engine(cfg, hooks, parts)
    restore(loaded, cfg, checkpoint, None)
    return loaded


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
    size = checkpoint_bytes(cfg, engine.parts, hooks)
    work = Path(tempfile.mkdtemp(prefix="ipuft-bench-", dir=args.dir))
    times: dict[str, list[float]] = {"save": [], "save_base": [], "load": [], "load_base": []}
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
    for what, base in (("save", "safetensors save_file + fsync"), ("load", "safetensors load_file")):
        ours, theirs = size / median[what] / 1e9, size / median[f"{what}_base"] / 1e9
        print(f"{what}: ipuft {ours:.2f} GB/s, {base} {theirs:.2f} GB/s, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
