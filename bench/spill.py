"""Activations spilled to disk (``execution.activation_offload=disk``) against the same run with them in host
memory (``activation_offload=true``), at GPT-J-6B's width and at Llama-3-8B's, two layers, on this machine's
CPU and disk:

    OMP_NUM_THREADS=2 python bench/spill.py --spill-dir /path/on/the/disk/to/measure \
        [--widths gptj llama] [--seq 256] [--ga 4] [--steps 2] [KEY=VALUE ...]

Each configuration runs as ``ipuft bench`` in a process of its own, after ``ipuft plan`` of the same config
(bench/width.py's ``ipuft``), and prints its step time, peak RSS against the plan's ``host_needed_bytes``, the
bytes a step wrote to disk against the plan's ``disk_bytes``, and how much the page cache grew over what it
was when the child started (the cgroup's file pages, ``memory.stat``'s ``file`` or v1's ``total_cache``,
else ``/proc/meminfo``'s ``Cached``, sampled every 0.2 s while the child runs; other processes in the cgroup
move it too). The ratio to read is the in-memory step's time over the spilled one's (1.0: as fast).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time

import torch
from width import ipuft

WIDTHS = {
    "gptj": ["--config", "tiny", "model.hidden_size=4096", "model.attention.heads=16", "model.attention.rotary_dim=64",
             "model.embedding.vocab_size=50400", "model.precision=bfloat16", "training.stochastic_rounding=true"],
    # Llama-3-8B's shapes (bfloat16 weights and compute, float32 Adam), every weight trained: about 18.6 GiB of
    # host memory with its two 128256-row tables (add model.freeze=[embeddings] for some 14 GiB).
    "llama": ["--config", "llama3-8b"],
}


def cached_bytes() -> int:
    """The page cache charged to this cgroup (v2's ``file``, v1's ``total_cache``), else the machine's."""
    for path, key in (("/sys/fs/cgroup/memory.stat", "file"), ("/sys/fs/cgroup/memory/memory.stat", "total_cache")):
        if os.path.exists(path):
            for line in open(path).read().splitlines():  # noqa: SIM115 (a one-shot read)
                if line.split()[0] == key:
                    return int(line.split()[1])
    for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    return 0


def run(width: str, placement: str, args, overrides: list[str]) -> dict:
    config = [*WIDTHS[width], "model.layers=2", f"model.sequence_length={args.seq}", "execution.device=cpu",
              "execution.micro_batch_size=1", f"training.global_batch_size={args.ga}", "checkpoint.save=null",
              f"execution.activation_offload={placement}", *overrides]
    if placement == "disk":
        config.append(f"execution.spill_dir={args.spill_dir}")
    plan, _ = ipuft(["plan", *config], dict(os.environ))
    base, peak, done = cached_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], cached_bytes() - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    bench, usage = ipuft(["bench", *config, "--steps", str(args.steps)], dict(os.environ))
    done.set()
    sampler.join()
    return {"width": width, "placement": placement, "step_s": bench["duration_s"], **usage,
            "host_needed_bytes": plan["machine"]["host_needed_bytes"], "host_bytes": plan["host_bytes"],
            "rss_of_plan": usage["max_rss_bytes"] / plan["machine"]["host_needed_bytes"],
            "disk_bytes": plan["disk_bytes"], "spill_written_bytes": bench["spill_written_bytes"],
            "spill_read_bytes": bench["spill_read_bytes"], "page_cache_growth_bytes": peak[0],
            "parameters": plan["parameters"]}


def report(r: dict, memory: dict | None) -> str:
    gib = 2**30
    line = (f"{r['width']:>5} {r['placement']:>4}: step {r['step_s']:7.2f} s; peak RSS "
            f"{r['max_rss_bytes'] / gib:6.2f} GiB = {r['rss_of_plan']:6.1%} of the plan's "
            f"{r['host_needed_bytes'] / gib:.2f} GiB; disk written "
            f"{r['spill_written_bytes']:,} B (plan {r['disk_bytes']:,} B, read back {r['spill_read_bytes']:,} B); "
            f"page cache grew at most {r['page_cache_growth_bytes'] / 2**20:,.0f} MiB")
    if memory is not None:
        line += f"; in-memory / spilled step time {memory['step_s'] / r['step_s']:.3f}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spill-dir", required=True, help="on the disk to measure (removed afterwards if we made it)")
    parser.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ga", type=int, default=4, help="micro-batches of one row (gradient accumulation)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each run (after an untimed one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings for every run")
    args = parser.parse_args()
    made = not os.path.exists(args.spill_dir)
    disk = shutil.disk_usage(os.path.dirname(os.path.abspath(args.spill_dir)) if made else args.spill_dir)
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; spill dir {args.spill_dir} "
          f"({disk.free / 2**30:,.0f} GiB free); seq {args.seq}, GA {args.ga}", flush=True)
    try:
        for width in args.widths:
            memory = run(width, "true", args, args.overrides)
            print(json.dumps(memory) if args.json else report(memory, None), flush=True)
            spilled = run(width, "disk", args, args.overrides)
            print(json.dumps(spilled) if args.json else report(spilled, memory), flush=True)
            if spilled["spill_written_bytes"] != spilled["disk_bytes"]:
                sys.exit(f"{width}: wrote {spilled['spill_written_bytes']} B, the plan says {spilled['disk_bytes']}")
    finally:
        if made:
            shutil.rmtree(args.spill_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
