"""Data at MNLI's size: tokenizing a generated 393k-row MNLI-like JSONL file, then a second run that reads
the memory-mapped token cache instead.

    python bench/data.py [--rows N]

Prints the seconds of each and their ratio. Uses the shipped 512-token sample tokenizer (GPT-J's is not
shipped) and a cache directory of its own. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.plugins import create_plugin_manager

WORDS = ["the", "a", "cat", "dog", "man", "woman", "child", "runs", "sleeps", "eats", "reads", "sits", "stands",
         "walks", "in", "on", "under", "near", "house", "park", "street", "car", "book", "table", "happy", "sad",
         "quickly", "slowly", "today", "yesterday", "red", "blue", "green", "big", "small"]


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24))).capitalize() + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=392_702)  # MNLI's training rows
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mnli_like.jsonl"
        rng = random.Random(0)
        with path.open("w") as f:
            for _ in range(args.rows):
                f.write(json.dumps({"premise": sentence(rng), "hypothesis": sentence(rng), "label": rng.randint(0, 2)})
                        + "\n")
        os.environ["IPUFT_CACHE_DIR"] = str(Path(tmp) / "cache")
        hooks = create_plugin_manager()
        cfg = load_config("small-cpu", [f"data.path={path}", "model.sequence_length=128"],
                          hooks.registrations.config_sections)
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            dataset = data_source(cfg)
            seconds.append(time.perf_counter() - start)
        print(f"rows: {args.rows:,} ({path.stat().st_size / 2**20:.0f} MiB), packed chunks: {len(dataset):,}")
        print(f"first run (read, tokenize, pack, cache): {seconds[0]:6.2f} s")
        print(f"second run (memory-mapped cache):        {seconds[1]:6.2f} s   ({seconds[0] / seconds[1]:.0f}x faster)")


if __name__ == "__main__":
    main()
