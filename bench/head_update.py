"""The chunked head (``execution.head_chunk_tokens``) and the streamed update (``execution.update_piece_bytes``)
at GPT-J-6B's width, against both off, in the same script: step time and the two phases they change.

    python bench/head_update.py [KEY=VALUE ...] [--seq 256] [--steps 3] \
        [--precision bfloat16] [--chunk N]

One layer, gradient accumulation 2, each configuration run by ``bench/width.py``'s ``run`` (``ipuft bench
--profile`` in a process of its own, after ``ipuft plan``), in this order: both off, both at their defaults,
and with ``--chunk N`` the head in chunks of N tokens (several chunks a micro-batch). It prints each run's step time
and its ``head:loss_backward`` and update phases' times, each against the first run's as a ratio. Not a
test: the machines are noisy, so read the ratios, from one run each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from width import run

OFF = ("execution.head_chunk_tokens=0", "execution.update_piece_bytes=0")


def update_seconds(profile: dict) -> float:
    """The seconds of the phases that update: each decoder layer's and the head's optimizer step, and the
    embeddings' backward (their backward, the global norm and their update)."""
    phases = profile["phases"]
    return sum(kinds.get("optimizer", 0.0) for kinds in phases.values()) + phases["embeddings"]["backward"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--chunk", type=int, default=None, help="a third run with this execution.head_chunk_tokens")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings for every run")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; 1 layer at GPT-J-6B's width, seq {args.seq}, "
          f"micro-batch 1, GA 2, {args.precision}", flush=True)
    runs = {"both off (head whole, unit update)": OFF, "defaults (chunked head, streamed update)": ()}
    if args.chunk is not None:
        runs[f"head in chunks of {args.chunk}, streamed update"] = (f"execution.head_chunk_tokens={args.chunk}",)
    results = {}
    for name, overrides in runs.items():
        r = run(1, args.seq, 1, args.precision, args.steps, dict(os.environ), (*args.overrides, *overrides))
        head = r["profile"]["phases"]["head"]["loss_backward"]
        results[name] = (r["step_s"], head, update_seconds(r["profile"]))
        base = next(iter(results.values()))
        print(f"{name}: step {r['step_s']:.2f} s (x{r['step_s'] / base[0]:.3f}), head:loss_backward {head:.2f} s "
              f"(x{head / base[1]:.3f}), update phases {results[name][2]:.2f} s (x{results[name][2] / base[2]:.3f}); "
              f"peak RSS {r['max_rss_bytes'] / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
